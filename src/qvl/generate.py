"""The model steps of generation over the paged KV cache: `prefill_slice` (a run of prompt
tokens of one row) and `decode_step` (one token for each of several rows). The scheduler
(qvl.scheduler) drives them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qvl.deadline import Cancelled
from qvl.kernels.products import prompt_products
from qvl.kv_cache import KVCache, contiguous_cache
from qvl.model.qwen3_vl import Qwen3VL
from qvl.state_cache import StatePool, StateRows

PREFILL_CHUNK = 512  # tokens per prefill step: bounds the attention matrix of long prompts

CancelCheck = Callable[[], bool]  # True = stop now (client gone, time limit)


def check(cancel: CancelCheck | None) -> None:
    if cancel is not None and cancel():
        raise Cancelled()


@dataclass
class PreparedPrompt:
    """A tokenized prompt with its images already encoded."""

    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [3, T] M-RoPE positions
    next_position: int  # position of the first generated token
    image_embeds: torch.Tensor | None = None  # [n, D] for the image tokens from embeds_from on
    deepstack: list[torch.Tensor] | None = None  # each [n, D]
    embeds_from: int = 0  # image tokens before the first embedded one (already in a reused prefix)

    def __len__(self) -> int:
        return self.ids.shape[0]


@torch.inference_mode()
def prefill_slice(model: Qwen3VL, cache: KVCache, prompt: PreparedPrompt, start: int,
                  end: int, hidden: bool = False) -> torch.Tensor | None:
    """Run prompt tokens start..end through the decoder into positions start..end of a B=1
    cache (or one row's view), whose first `start` positions already hold the prompt's first tokens.
    Returns the logits of the prompt's last token [1, V] when the slice ends the prompt (with
    `hidden`, its final-normed hidden state [1, D] instead: the head does not run), else None
    (the final layer then only writes its keys and values, and the head does not run)."""
    is_image = model.cfg.is_vision_token(prompt.ids)
    done_images = int(is_image[:start].sum()) - prompt.embeds_from  # image tokens before start, already embedded
    vis = is_image[start:end][None]
    n_vis = int(vis.sum())
    embeds = deepstack = None
    if n_vis:
        embeds = prompt.image_embeds[done_images : done_images + n_vis]
        deepstack = [d[done_images : done_images + n_vis] for d in prompt.deepstack]
    h = model.embed(prompt.ids[start:end][None], embeds)
    cos, sin = model.rope(prompt.positions[:, None, start:end])
    wanted = int(end == len(prompt))
    with prompt_products():  # the same products for a prompt token whatever the slice (the head: one row, always)
        h_last = model.language_model(h, cos, sin, cache, start, vis, deepstack, last=wanted)
    if not wanted:
        return None
    return h_last[:, -1] if hidden else model.logits(h_last)[:, -1]


def prefill(
    model: Qwen3VL, cache: KVCache, prompt: PreparedPrompt, *, skip: int = 0, chunk: int = PREFILL_CHUNK,
    cancel: CancelCheck | None = None,
) -> torch.Tensor:
    """The whole prompt from token `skip` on (the first `skip` positions already hold it), in
    slices of `chunk` tokens. Returns the logits of the last token [1, V]."""
    logits = None
    for s in range(skip, len(prompt), chunk):
        check(cancel)
        logits = prefill_slice(model, cache, prompt, s, min(s + chunk, len(prompt)))
    return logits


@torch.inference_mode()
def decode_step(model: Qwen3VL, cache: KVCache, tokens: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """One token per row: tokens [B] written at positions slots [B] (each row's length so far)
    of the cache's B rows, at M-RoPE positions [B] (the same on all three axes). Returns
    logits [B, V]."""
    h = model.embed(tokens[:, None])
    cos, sin = model.rope(positions.view(1, -1, 1).expand(3, -1, 1))
    return model.logits(model.language_model(h, cos, sin, cache, slots))[:, -1]


def new_cache(model: Qwen3VL, batch: int, capacity: int) -> KVCache:
    """A cache of its own for `batch` rows of `capacity` positions (outside the scheduler's
    pool), with a recurrent state per row for a hybrid model's linear layers."""
    t = model.cfg.text
    cache = contiguous_cache(len(t.attention_layers), batch, t.num_key_value_heads, capacity, t.head_dim, model.dtype)
    if model.cfg.hybrid:
        cache.states = StateRows(StatePool(t, batch, model.dtype), torch.arange(batch))
    return cache
