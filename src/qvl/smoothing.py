"""SmoothQuant-style smoothing for int8 activations: per-channel scales moved from a linear's
input into its weights, folded into what produces that input, so the product is unchanged in
float arithmetic but the activations a per-row int8 quantiser sees lose their outlier
channels. Pure torch, no I/O; the model is changed in place.

Where a scale s (one per input channel, shared by every linear reading that input) goes:
  text   input_layernorm.weight / s        -> q_proj, k_proj, v_proj columns * s
         post_attention_layernorm.weight / s -> gate_proj, up_proj columns * s
         up_proj rows / s                  -> down_proj columns * s  (silu(g) * u is linear in u)
  vision norm1.weight, norm1.bias / s      -> attn.qkv columns * s
         norm2.weight, norm2.bias / s      -> mlp.linear_fc1 columns * s
         attn.qkv v rows (and bias) / s    -> attn.proj columns * s  (attention is linear in v)
s_j = amax_act_j ** alpha / amax_w_j ** (1 - alpha), where amax_w_j is the largest |weight| of
input channel j over the fed linears and amax_act_j comes from calibration (absmax of each
linear's input over a few real inputs) or, data-free, from the preceding norm (|gamma_j|, plus
|beta_j| / NORMALIZED_AMAX for LayerNorm); data-free leaves the row pairs (no norm) alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qvl.model.qwen3_vl import Qwen3VL

NORMALIZED_AMAX = 4.0  # a normalised activation's typical absmax over tokens (for the beta term)
MIN_SCALE = 1e-5


@dataclass(frozen=True)
class SmoothGroup:
    """One place a scale vector goes: `source` produces the input of `consumers`; rows of the
    source (a norm: all of it; a linear: `rows`) are divided by s, the consumers' columns
    multiplied by it."""

    key: str  # name the scales are stored under
    source: str  # a norm or a linear (module name)
    consumers: tuple[str, ...]  # linears reading the source's output
    rows: tuple[int, int] | None = None  # source linear's output rows [start, end) feeding the consumers

    @property
    def from_norm(self) -> bool:
        return self.rows is None


def smooth_groups(model: Qwen3VL) -> list[SmoothGroup]:
    """Every smoothable input of the model's text layers and vision blocks."""
    groups = []
    for i in range(len(model.language_model.layers)):
        p = f"language_model.layers.{i}"
        groups += [
            SmoothGroup(f"{p}.input_layernorm", f"{p}.input_layernorm",
                        (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj")),
            SmoothGroup(f"{p}.post_attention_layernorm", f"{p}.post_attention_layernorm",
                        (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")),
            SmoothGroup(f"{p}.mlp.down_proj", f"{p}.mlp.up_proj", (f"{p}.mlp.down_proj",),
                        (0, model.cfg.text.intermediate_size)),
        ]
    d = model.cfg.vision.hidden_size
    for i in range(len(model.visual.blocks)):
        p = f"visual.blocks.{i}"
        groups += [
            SmoothGroup(f"{p}.norm1", f"{p}.norm1", (f"{p}.attn.qkv",)),
            SmoothGroup(f"{p}.norm2", f"{p}.norm2", (f"{p}.mlp.linear_fc1",)),
            SmoothGroup(f"{p}.attn.proj", f"{p}.attn.qkv", (f"{p}.attn.proj",), (2 * d, 3 * d)),
        ]
    return groups


# -- statistics ---------------------------------------------------------------------------

@torch.no_grad()
def calibrate(model: Qwen3VL, run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Per-channel absmax (float32 [I]) of every smoothed input while `run()` pushes inputs
    through the model (images through encode_images, prompts through the decoder), keyed by
    group key (smooth_groups). Gathered by hooks: a norm's output (forward hook: a fed linear
    may be called through a fused kernel that bypasses its module, as vision's fc1 + GELU is),
    else the consumer's input (forward pre-hook)."""
    stats: dict[str, torch.Tensor] = {}

    def record(key: str, x: torch.Tensor) -> None:
        amax = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        stats[key] = amax if key not in stats else torch.maximum(stats[key], amax)

    handles = []
    for g in smooth_groups(model):
        if g.from_norm:
            hook = lambda _m, _args, out, key=g.key: record(key, out)  # noqa: E731
            handles.append(model.get_submodule(g.source).register_forward_hook(hook))
        else:
            hook = lambda _m, args, key=g.key: record(key, args[0])  # noqa: E731
            handles.append(model.get_submodule(g.consumers[0]).register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return stats


def norm_proxy(norm: nn.Module) -> torch.Tensor:
    """Data-free activation absmax of a norm's output channels (up to one common factor)."""
    amax = norm.weight.detach().float().abs()
    if getattr(norm, "bias", None) is not None:
        amax = amax + norm.bias.detach().float().abs() / NORMALIZED_AMAX
    return amax


def weight_amax(model: Qwen3VL, group: SmoothGroup) -> torch.Tensor:
    """Largest |weight| of each input channel over the group's linears: [I] float32."""
    return torch.stack([model.get_submodule(c).weight.detach().float().abs().amax(0)
                        for c in group.consumers]).amax(0)


def smoothing_scales(act_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s_j = act_j^alpha / w_j^(1-alpha), normalised to geometric mean 1 (a common factor is
    absorbed by the per-row and per-channel quantisation scales anyway). [I] float32."""
    s = act_amax.clamp(min=MIN_SCALE).pow(alpha) / w_amax.clamp(min=MIN_SCALE).pow(1 - alpha)
    s = s / s.log().mean().exp()
    return s.clamp(min=MIN_SCALE)


# -- folding ------------------------------------------------------------------------------

@torch.no_grad()
def fold(model: Qwen3VL, group: SmoothGroup, s: torch.Tensor) -> None:
    """Divide the source's output channels by s and multiply the consumers' input columns by
    s (in float32, rounded once to each tensor's dtype): the function is unchanged."""
    source = model.get_submodule(group.source)
    start, end = group.rows if group.rows else (0, s.numel())
    for leaf in ("weight", "bias"):
        t = getattr(source, leaf, None)
        if t is None:
            continue
        new = t.detach().clone()  # new storage: loaded tensors may be memory-mapped from the file
        new[start:end] = new[start:end].float() / (s if new.dim() == 1 else s[:, None])
        t.data = new
    for name in group.consumers:
        w = model.get_submodule(name).weight
        w.data = (w.detach().float() * s).to(w.dtype)


def smooth(model: Qwen3VL, stats: dict[str, torch.Tensor] | None = None, alpha: float = 0.5,
           text: bool = True, vision: bool = True) -> dict[str, torch.Tensor]:
    """Fold smoothing scales into a float model (in place). With `stats` (from calibrate) every
    group is smoothed from measured activations; without, the norm groups use norm_proxy and
    the row pairs are left alone. Returns the scales by group key (to store beside the
    quantised weights)."""
    scales = {}
    for group in smooth_groups(model):
        if not (text if group.key.startswith("language_model.") else vision):
            continue
        if stats is not None:
            act = stats[group.key]
        elif group.from_norm:
            act = norm_proxy(model.get_submodule(group.source))
        else:
            continue
        s = smoothing_scales(act, weight_amax(model, group), alpha)
        fold(model, group, s)
        scales[group.key] = s
    return scales


def outlier_channels(stats: dict[str, torch.Tensor], ratio: float = 20.0) -> dict[str, torch.Tensor]:
    """Input channels whose absmax exceeds `ratio` x the median channel's, per group key
    (candidates to keep in float beside an int8 product, LLM.int8()-style)."""
    return {name: (a > ratio * a.median()).nonzero().flatten() for name, a in stats.items()}
