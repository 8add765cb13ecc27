"""The one generation path: `prefill` and `decode_step` over a preallocated KV cache,
and `generate_step`, which turns a prepared prompt into a stream of token ids for one
or several rows decoded together."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qvl.kv_cache import KVCache
from qvl.model.qwen3_vl import Qwen3VL
from qvl.sampling import SamplingParams, apply_penalties, sample

PREFILL_CHUNK = 512  # tokens per prefill step: bounds the attention matrix of long prompts

CancelCheck = Callable[[], bool]  # True = stop now (client gone, time limit)


class Cancelled(Exception):
    """Raised between steps when the request's cancel check says so."""


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
def prefill(
    model: Qwen3VL, cache: KVCache, prompt: PreparedPrompt, *, skip: int = 0, slot: int = 0,
    key_mask: torch.Tensor | None = None, chunk: int = PREFILL_CHUNK, cancel: CancelCheck | None = None,
) -> torch.Tensor:
    """Run prompt tokens skip..T through the decoder into cache slots slot+skip.. (a B=1
    cache or one row's view). The first `skip` tokens must already be cached (prefix
    reuse). Returns the logits of the last token [1, V]."""
    image_token = model.cfg.image_token_id
    is_image = prompt.ids == image_token
    done_images = int(is_image[:skip].sum()) - prompt.embeds_from
    h_last = None
    for s in range(skip, len(prompt), chunk):
        check(cancel)
        e = min(s + chunk, len(prompt))
        ids = prompt.ids[s:e][None]
        vis = is_image[s:e][None]
        n_vis = int(vis.sum())
        embeds = deepstack = None
        if n_vis:
            embeds = prompt.image_embeds[done_images : done_images + n_vis]
            deepstack = [d[done_images : done_images + n_vis] for d in prompt.deepstack]
            done_images += n_vis
        h = model.embed(ids, embeds)
        cos, sin = model.rope(prompt.positions[:, None, s:e])
        h_last = model.language_model(h, cos, sin, cache, slot + s, key_mask, vis, deepstack)[:, -1:]
    return model.logits(h_last)[:, -1]


@torch.inference_mode()
def decode_step(
    model: Qwen3VL, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """tokens: [B] at M-RoPE positions [B] (same on all three axes), written at slot
    cache.length. Returns logits [B, V]."""
    h = model.embed(tokens[:, None])
    cos, sin = model.rope(positions.view(1, -1, 1).expand(3, -1, 1))
    return model.logits(model.language_model(h, cos, sin, cache, cache.length, key_mask))[:, -1]


def new_cache(model: Qwen3VL, batch: int, capacity: int) -> KVCache:
    """Rows of a batch may hold masked, never-written slots: zero them (garbage could be
    NaN, and NaN * 0 poisons attention). A single row only ever reads what it wrote."""
    t = model.cfg.text
    return KVCache(t.num_hidden_layers, batch, t.num_key_value_heads, capacity, t.head_dim, model.dtype,
                   zeroed=batch > 1)


def generate_step(
    model: Qwen3VL, prompts: list[PreparedPrompt], params: SamplingParams, eos_ids: tuple[int, ...],
    *, cache: KVCache | None = None, prefixes: list[tuple[KVCache, int] | None] | None = None,
    cancel: CancelCheck | None = None,
) -> Iterator[list[int | None]]:
    """Yield, per step, the next token of each row (None for a row already finished).

    Rows are right-aligned in one cache (shorter prompts padded on the left and masked),
    prefilled one by one and decoded together. prefixes[r] = (kv, n): a B=1 cache whose
    first n positions hold row r's first n prompt tokens, which are then not recomputed.
    A row finishes on one of `eos_ids` (pass () to ignore EOS) or after max_new_tokens.
    `cancel` is checked before every prefill chunk and decode step (raises Cancelled).
    """
    batch, width = len(prompts), max(len(p) for p in prompts)
    if cache is None:
        cache = new_cache(model, batch, width + params.max_new_tokens)
    key_mask = None
    if any(len(p) != width for p in prompts):
        key_mask = torch.zeros(batch, cache.capacity, dtype=torch.bool)
        key_mask[:, width:] = True
    logits = []
    for r, p in enumerate(prompts):
        pad = width - len(p)
        row_mask = None
        if key_mask is not None:
            key_mask[r, pad:width] = True
            row_mask = key_mask[r : r + 1]
        row_cache = cache.row(r) if batch > 1 else cache
        prefix, skip = prefixes[r] if prefixes and prefixes[r] else (None, 0)
        if prefix is not None:
            row_cache.write_prefix(prefix, skip, slot=pad)
        logits.append(prefill(model, row_cache, p, skip=skip, slot=pad, key_mask=row_mask, cancel=cancel))
    cache.length = width
    logits = torch.cat(logits)
    vocab = logits.shape[-1]
    seen = torch.zeros(batch, vocab, dtype=torch.bool)
    if params.repetition_penalty != 1.0:
        for r, p in enumerate(prompts):
            seen[r, p.ids[p.ids < vocab]] = True
    counts = torch.zeros(batch, vocab)
    generators = None if params.seed is None else [torch.Generator().manual_seed(params.seed) for _ in prompts]
    positions = torch.tensor([p.next_position for p in prompts])
    alive = torch.ones(batch, dtype=torch.bool)
    stop = torch.tensor(list(eos_ids), dtype=torch.long)
    for step in range(params.max_new_tokens):
        tokens = sample(apply_penalties(logits, seen, counts, params), params, generators)
        yield [int(t) if a else None for t, a in zip(tokens.tolist(), alive.tolist())]
        alive &= ~torch.isin(tokens, stop)
        if not alive.any() or step + 1 == params.max_new_tokens:
            return
        seen[torch.arange(batch), tokens] = True
        counts[torch.arange(batch), tokens] += 1
        check(cancel)
        with torch.inference_mode():
            logits = decode_step(model, cache, tokens, positions + step, key_mask)
