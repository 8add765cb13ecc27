"""The model's ops (qvl.model calls these): each runs the native kernel the plan names for its
dtype, and the reference's torch ops where the plan says torch or the kernel does not take the
inputs. The vision tower's attention follows its module's plan (int8 x int8 linears: integer
codes); the rest depends only on the library and the dtype (plan.default_plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from qvl.kernels import attention, decode_step, delta_rule, elementwise
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan
from qvl.model.rope import apply_rotary

if TYPE_CHECKING:
    from qvl.kv_cache import KVCache

# torch's fused CPU linear + pointwise op (oneDNN), which torch.compile emits; None without oneDNN's
# native bf16 support (as torch.compile gates it)
LINEAR_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None) \
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim (x: [..., D], weight [D]), rounded as the reference rounds."""
    if x.dtype == weight.dtype and default_plan(x.dtype).rms_norm == "qvl_rmsnorm":
        return elementwise.rms_norm(library().lib, x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaling by (1 + weight) (Qwen3.5; x: [..., D], weight [D]), in float32 and
    rounded once, as the reference does (natively where rms_norm is: the one-call decode step's kernel)."""
    if x.dtype == weight.dtype and default_plan(x.dtype).rms_norm == "qvl_rmsnorm":
        return elementwise.rms_norm(library().lib, x, weight, eps, zero_centred=True)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] scaled by weight [D], times silu(gate) [..., D] (the Gated DeltaNet's
    output norm), rounded as the reference rounds: in one native pass where rms_norm is native."""
    if x.dtype == gate.dtype == weight.dtype and x.shape == gate.shape \
            and default_plan(x.dtype).rms_norm == "qvl_rmsnorm":
        return elementwise.gated_rms_norm(library().lib, x, gate, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the same shape), rounded as the reference rounds."""
    if gate.dtype == up.dtype and default_plan(gate.dtype).silu_mul == "qvl_silu_mul":
        return elementwise.silu_mul(library().lib, gate, up)
    return F.silu(gate) * up


def text_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefill: bool) -> torch.Tensor:
    """x [B, H, T, hd] rotated by cos/sin [B, 1, T, hd]: one native pass for a prefill row
    (any T, so that a prompt token rounds alike in any slice), else the reference's ops."""
    if prefill and x.shape[0] == 1 and default_plan(x.dtype).text_rope == "qvl_text_rope":
        if (out := elementwise.text_rope(library().lib, x, cos, sin)) is not None:
            return out
    return apply_rotary(x, cos, sin)


def causal_mask(start: int, length: int) -> torch.Tensor:
    q = torch.arange(start, start + length)[:, None]
    return (torch.arange(start + length)[None, :] <= q)[None, None]


def cache_attention(q: torch.Tensor, cache: KVCache, layer: int, start: int | torch.Tensor) -> torch.Tensor:
    """Causal attention of new queries over the paged cache (GQA), whose rows already hold
    their keys and values. start an int: q [B, H, T, hd] at positions start..start+T of each
    row. start [B] (one query per row, T = 1): row b's query at position start[b] attends to
    its first start[b]+1 positions only, so its result is the same whatever the other rows
    hold. The native kernels read through the block tables: one query per row (decoding), and
    causal prefill of one row; torch's SDPA gathers the rows' keys."""
    b, _, t, _ = q.shape
    plan, out = default_plan(q.dtype), None
    keys, values = cache.pool.keys[layer], cache.pool.values[layer]
    decoding = isinstance(start, torch.Tensor)  # a prompt's token takes prefill's kernel, even alone
    if decoding and plan.decode_attention == "qvl_decode_attention":
        out = attention.decode_attention(library().lib, q, keys, values, cache.table, start + 1)
    elif not decoding and b == 1 and plan.prefill_attention == "qvl_attention":
        out = attention.paged_attention(library().lib, q[0].transpose(0, 1), keys, values, cache.table[0], start)
        out = None if out is None else out.transpose(0, 1)[None]
    if out is not None:
        return out
    if decoding:  # row by row over its own keys: nothing of another row enters
        return torch.cat([F.scaled_dot_product_attention(q[i : i + 1], *cache.row(i).gather(layer, n + 1),
                                                         enable_gqa=True)
                          for i, n in enumerate(start.tolist())])
    keys, values = cache.gather(layer, start + t)
    mask = causal_mask(start, t) if start > 0 else None  # SDPA's is_causal aligns the diagonal top-left
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     lengths: list[int], kernel: str | None = None) -> torch.Tensor:
    """The vision tower's attention, inside each image: q, k, v [N, H, hd] (k and q not rotated
    yet), cos/sin [N, 1, hd], lengths: patches per image -> [N, H, hd]. `kernel`: the module's
    plan (None: the dtype's float kernel)."""
    kernel = kernel or default_plan(q.dtype).vision_attention
    if kernel == "qvl_attention_i16":
        outs = [integer_image_attention(*parts) for parts in zip(*(t.split(lengths) for t in (q, k, v, cos, sin)))]
    else:
        q, k = vision_rotary(q, cos, sin), vision_rotary(k, cos, sin)
        attend = byte_image_attention if kernel == "qvl_attention_q8" else image_attention
        outs = [attend(qi, ki, vi) for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full attention over one image's patches: q, k, v [n, H, hd] -> [n, H, hd]. qvl's flash
    kernel where the plan has it and the head size suits it, else SDPA (4-D: a 3-D call silently
    takes torch's slow math path)."""
    out = attention.attention(library().lib, q, k, v) \
        if default_plan(q.dtype).image_attention == "qvl_attention" else None
    if out is None:
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
    return out


def byte_image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """image_attention in 8-bit integer codes (qvl_attention_q8: scores, P and V): q, k rotated,
    [n, H, hd]. Where it declines (a NaN or infinity, a head size it does not take), image_attention."""
    out = attention.attention_q8(library().lib, q, k, v)
    return out if out is not None else image_attention(q, k, v)


def integer_image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    """image_attention in 16-bit integer codes (qvl_attention_i16): q and k [n, H, hd] not
    rotated yet, cos/sin [n, 1, hd]; the kernel rotates them as it codes them. Where it declines
    (a NaN or infinity, a head size it does not take), the float path."""
    out = attention.attention_i16(library().lib, q, k, v, cos, sin)
    if out is None:
        out = image_attention(vision_rotary(q, cos, sin), vision_rotary(k, cos, sin), v)
    return out


def vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, hd] (strided view of the fused qkv) rotated in float32 and rounded back to
    x's dtype once; the native pass reads the view and writes the result in one go."""
    out = elementwise.vision_rope(library().lib, x, cos, sin) \
        if default_plan(x.dtype).vision_rope == "qvl_vision_rope" else None
    return out if out is not None else apply_rotary(x.float(), cos, sin).to(x.dtype)


def norm_linear(norm: nn.LayerNorm, fc: nn.Module, x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """fc(norm(x)), tanh-GELU'd when `gelu_tanh`. Layers that say `fuses_layer_norm`
    (qvl.quantize's Int8Linear) take the norm and apply it in their quantise pass: the
    normalised rows are never written."""
    if getattr(fc, "fuses_layer_norm", False):
        return fc(x, gelu_tanh=gelu_tanh, norm=norm)
    return linear_gelu_tanh(fc, norm(x)) if gelu_tanh else fc(norm(x))


def residual_linear(fc: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + fc(x). Layers that say `fuses_residual` (qvl.quantize's Int8Linear) add it in
    their last pass over the output, rounding the product and then the sum, as the two steps do."""
    if getattr(fc, "fuses_residual", False):
        return fc(x, residual=residual)
    return residual + fc(x)


def linear_gelu_tanh(fc: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(fc(x)). With bf16 float weights, one oneDNN call applies the GELU to the GEMM's
    float32 results before they are rounded (torch's own fused CPU linear, as torch.compile
    emits it): one bf16 rounding instead of two. Layers that say `fuses_gelu_tanh`
    (qvl.quantize's Int8Linear) take `gelu_tanh=True` and fuse it themselves."""
    if getattr(fc, "fuses_gelu_tanh", False):
        return fc(x, gelu_tanh=True)
    if (type(fc) is nn.Linear and x.dtype == torch.bfloat16 and fc.weight.dtype == torch.bfloat16 and x.dim() == 2
            and LINEAR_POINTWISE is not None):
        return LINEAR_POINTWISE(x, fc.weight, fc.bias, "gelu", [None], "tanh")
    return F.gelu(fc(x), approximate="tanh")


def decode_layers(model: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                  slots: torch.Tensor) -> torch.Tensor | None:
    """A decode step through every decoder layer of `model` (qvl.model.text.TextModel) in one
    native call where the plan has it (see kernels.decode_step.run); None: run the layers."""
    if default_plan(h.dtype).decode_step != "qvl_decode_layers":
        return None
    return decode_step.run(model, h, cos, sin, cache, slots)


def rows_independent(model: nn.Module) -> bool:
    """Whether a decode step of `model` computes each row as it would alone (see
    kernels.decode_step.rows_independent)."""
    return decode_step.rows_independent(model)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, offset: int) -> torch.Tensor:
    """Gated DeltaNet's prefill of one row: q, k [T, Hk, Dk], v [T, Hv, Dv] (model dtype, not
    L2-normalised), g (log decay), beta [T, Hv] float32, state [Hv, Dk, Dv] float32 (updated in
    place), offset the absolute position of token 0 -> out [T, Hv, Dv] in v's dtype. Chunks of
    delta_rule.CHUNK at absolute multiples of it: slices ending at such multiples compute the
    same bits as one call."""
    if default_plan(v.dtype).delta_rule == "qvl_gated_delta_rule":
        if (out := delta_rule.native_gated_delta_rule(library().lib, q, k, v, g, beta, state, offset)) is not None:
            return out
    return delta_rule.reference_gated_delta_rule(q, k, v, g, beta, state, offset)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's decode step, one token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta
    [B, Hv] float32, states [S, Hv, Dk, Dv] float32, slots [B] int64 (distinct): row b updates
    states[slots[b]] in place -> out [B, Hv, Dv] in v's dtype, each row as it would be alone."""
    if default_plan(v.dtype).delta_step == "qvl_gated_delta_step":
        if (out := delta_rule.native_gated_delta_step(library().lib, q, k, v, g, beta, states, slots)) is not None:
            return out
    return delta_rule.reference_gated_delta_step(q, k, v, g, beta, states, slots)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's short convolution, prefill of one row: x [T, C], weight [C, K], conv_state
    [C, K-1] (the inputs before x; updated in place to the last K-1) -> silu(causal depthwise
    conv) [T, C] in x's dtype."""
    if default_plan(x.dtype).delta_rule == "qvl_gated_delta_rule":
        if (y := delta_rule.native_causal_conv(library().lib, x, weight, conv_state)) is not None:
            return y
    return delta_rule.reference_causal_conv(x, weight, conv_state)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """The short convolution's decode step: x [B, C], weight [C, K], conv_states [S, C, K-1],
    slots [B] int64 (distinct): row b updates conv_states[slots[b]] in place -> [B, C]."""
    if default_plan(x.dtype).delta_step == "qvl_gated_delta_step":
        if (y := delta_rule.native_causal_conv_step(library().lib, x, weight, conv_states, slots)) is not None:
            return y
    return delta_rule.reference_causal_conv_step(x, weight, conv_states, slots)
