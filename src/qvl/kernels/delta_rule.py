"""Gated DeltaNet's ops (Qwen3.5's linear-attention layers): the gated delta rule (prefill in
chunks, one decode step over a pool of states) and the short causal convolution before it.
The torch reference of each, and the ctypes bindings of the native kernels (csrc/delta_rule.c);
a binding returns None where it does not take the inputs (the caller runs the reference).

The delta rule per value head, per token t: S = S * exp(g_t); u = beta_t (v_t - S^T k_t);
S = S + k_t u^T; o_t = S^T q_t, with q and k L2-normalised (and q scaled by Dk**-0.5) first.
Prefill computes it in chunks of CHUNK tokens whose boundaries fall on absolute positions that
are multiples of CHUNK, each chunk from its own tokens and the state before it only: a prompt
run in one call, in slices ending at multiples of CHUNK, or resumed from a state taken at such
a multiple, computes the same bits. Why CHUNK is 32: docs/decisions/delta-rule-chunk.md."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from qvl.kernels.build import DTYPES
from qvl.threads import kernel_threads

CHUNK = 32  # tokens per chunk of the prefill delta rule (chunks start at absolute multiples of it)
L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon


def chunk_bounds(offset: int, length: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of tokens 0..length at absolute positions offset..offset+length:
    the chunks end at absolute multiples of CHUNK (the last at `length`)."""
    bounds, start = [], 0
    while start < length:
        end = min(length, (offset + start) // CHUNK * CHUNK + CHUNK - offset)
        bounds.append((start, end))
        start = end
    return bounds


def _heads(x: torch.Tensor, hv: int, scale: float | None = None) -> torch.Tensor:
    """q or k [N, Hk, Dk] -> L2-normalised float32 (times `scale`), one per value head: [N, Hv, Dk]."""
    x = x.float()
    x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
    if scale is not None:
        x = x * scale
    return x.repeat_interleave(hv // x.shape[1], dim=1)


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_shape: torch.Size) -> None:
    hk, hv = q.shape[-2], v.shape[-2]
    if k.shape != q.shape or hv % hk or state_shape[-3:] != (hv, q.shape[-1], v.shape[-1]):
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and state "
                         f"{tuple(state_shape)} do not fit (q, k [.., Hk, Dk], v [.., Hv, Dv], state [.., Hv, Dk, Dv], "
                         f"Hv a multiple of Hk)")


def reference_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, offset: int) -> torch.Tensor:
    """Prefill of one row in torch: q, k [T, Hk, Dk], v [T, Hv, Dv] (model dtype, not normalised),
    g, beta [T, Hv] float32, state [Hv, Dk, Dv] float32 (updated in place), `offset` the absolute
    position of token 0 -> out [T, Hv, Dv] in v's dtype. Chunk by chunk (see the module)."""
    _check_heads(q, k, v, state.shape)
    hv, dk = v.shape[1], q.shape[2]
    qs = _heads(q, hv, dk**-0.5).transpose(0, 1).contiguous()  # [Hv, T, Dk]
    ks = _heads(k, hv).transpose(0, 1).contiguous()
    vs = v.float().transpose(0, 1).contiguous()  # [Hv, T, Dv]
    gs, bs = g.float().t().contiguous(), beta.float().t().contiguous()  # [Hv, T]
    out = torch.empty_like(vs)
    s = state.clone()
    for a, b in chunk_bounds(offset, v.shape[0]):
        out[:, a:b], s = _chunk(*(x[:, a:b].contiguous() for x in (qs, ks, vs, gs, bs)), s)
    state.copy_(s)
    return out.transpose(0, 1).to(v.dtype)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of L tokens for every value head: q, k [Hv, L, Dk], v [Hv, L, Dv], g, beta [Hv, L],
    s [Hv, Dk, Dv] the state before it -> (out [Hv, L, Dv], the state after it). With b = the
    cumulative log decay inside the chunk, the values written (u, solved from a unit lower
    triangular system) are (I + A) U = beta (V - exp(b) K S), A[i, j] = beta_i k_i.k_j
    exp(b_i - b_j) for j < i; o_i = exp(b_i) S^T q_i + sum_{j <= i} exp(b_i - b_j) q_i.k_j u_j."""
    n = g.shape[1]
    b = g.cumsum(-1)  # [Hv, L]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    decay = (b[:, :, None] - b[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, L, L]
    a = (k @ k.transpose(-1, -2)) * decay * beta[:, :, None]
    rhs = beta[:, :, None] * (v - b.exp()[:, :, None] * (k @ s))
    u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # a's diagonal is read as 1
    out = b.exp()[:, :, None] * (q @ s) + ((q @ k.transpose(-1, -2)) * decay) @ u
    s = s * b[:, -1:, None].exp() + (k * (b[:, -1:] - b).exp()[:, :, None]).transpose(-1, -2) @ u
    return out, s


def reference_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One decode token per row in torch: q, k [B, Hk, Dk], v [B, Hv, Dv] (model dtype, not
    normalised), g, beta [B, Hv] float32, states [S, Hv, Dk, Dv] float32, slots [B] int64 (distinct):
    row b updates states[slots[b]] in place -> out [B, Hv, Dv] in v's dtype."""
    _check_heads(q, k, v, states.shape)
    hv = v.shape[1]
    qs, ks = _heads(q, hv, q.shape[2] ** -0.5), _heads(k, hv)  # [B, Hv, Dk]
    s = states[slots] * g.float().exp()[:, :, None, None]  # [B, Hv, Dk, Dv]
    u = beta.float()[:, :, None] * (v.float() - (s * ks[..., None]).sum(-2))  # [B, Hv, Dv]
    s = s + ks[..., None] * u[:, :, None, :]
    states[slots] = s
    return (s * qs[..., None]).sum(-2).to(v.dtype)


def _conv_silu(windows: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu of the depthwise products: windows [..., C, K] (K inputs per channel, oldest first),
    weight [C, K] -> [..., C]: summed in float32, rounded to the weight's dtype (the reference's
    conv runs in it), SiLU'd in it, returned in `dtype`."""
    return F.silu((windows.float() * weight.float()).sum(-1).to(weight.dtype)).to(dtype)


def reference_causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Prefill of one row in torch: x [T, C], weight [C, K], conv_state [C, K-1] (the K-1 inputs
    before x, oldest first; updated in place to the last K-1 inputs) -> silu(causal depthwise
    conv) [T, C] in x's dtype."""
    t, c = x.shape
    kk = weight.shape[1]
    if weight.shape[0] != c or conv_state.shape != (c, kk - 1):
        raise ValueError(f"causal conv: x {tuple(x.shape)}, weight {tuple(weight.shape)} and state "
                         f"{tuple(conv_state.shape)} do not fit (x [T, C], weight [C, K], state [C, K-1])")
    full = torch.cat([conv_state.t().to(x.dtype), x])  # [K-1+T, C]
    y = _conv_silu(full.unfold(0, kk, 1), weight, x.dtype)  # windows [T, C, K]
    conv_state.copy_(full[t:].t())
    return y


def reference_causal_conv_step(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                               slots: torch.Tensor) -> torch.Tensor:
    """One decode token per row in torch: x [B, C], weight [C, K], conv_states [S, C, K-1],
    slots [B] int64 (distinct): row b updates conv_states[slots[b]] in place -> [B, C] in x's dtype."""
    full = torch.cat([conv_states[slots].to(x.dtype), x[:, :, None]], -1)  # [B, C, K]
    conv_states[slots] = full[:, :, 1:].to(conv_states.dtype)
    return _conv_silu(full, weight, x.dtype)


# -- the native kernels (csrc/delta_rule.c): None where they do not take the inputs ---------------

def _rows(x: torch.Tensor) -> bool:
    """x [N, H, D] (or [N, C]) of a kernel dtype with its last dim contiguous."""
    return x.dtype in DTYPES and x.stride(-1) == 1


def _floats(*xs: torch.Tensor) -> bool:
    return all(x.dtype == torch.float32 and x.is_contiguous() for x in xs)


def _check_slots(slots: torch.Tensor, pool: int, rows: int, what: str) -> torch.Tensor:
    """slots as contiguous int64, after checking there is one per row and each names a slot of the pool."""
    slots = slots.to(torch.int64).contiguous()
    if slots.shape != (rows,) or (rows and (int(slots.min()) < 0 or int(slots.max()) >= pool)):
        raise IndexError(f"{what}: slots {slots.tolist()} are not one per row of {rows} in a pool of {pool}")
    return slots


def native_gated_delta_rule(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, offset: int,
                            chunk: int = CHUNK) -> torch.Tensor | None:
    """reference_gated_delta_rule in one native call (q, k, v: any token/head strides, D
    contiguous; g, beta, state contiguous float32). `chunk`: CHUNK except when measuring others."""
    _check_heads(q, k, v, state.shape)
    if not (_rows(q) and _rows(k) and _rows(v) and q.dtype == k.dtype == v.dtype and _floats(g, beta, state)):
        return None
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty(t, hv, dv, dtype=v.dtype)
    status = lib.qvl_gated_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), DTYPES[v.dtype], t, hk, hv, dk, dv,
                                      *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], g.data_ptr(),
                                      beta.data_ptr(), state.data_ptr(), out.data_ptr(), offset, chunk,
                                      kernel_threads())
    if status == -1:
        raise MemoryError("qvl_gated_delta_rule could not allocate its chunk buffers")
    return out if status == 0 else None


def native_gated_delta_step(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """reference_gated_delta_step in one native call (each state read from memory once)."""
    _check_heads(q, k, v, states.shape)
    if not (_rows(q) and _rows(k) and _rows(v) and q.dtype == k.dtype == v.dtype and _floats(g, beta, states)):
        return None
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    slots = _check_slots(slots, states.shape[0], b, "gated delta step")
    out = torch.empty(b, hv, dv, dtype=v.dtype)
    status = lib.qvl_gated_delta_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), DTYPES[v.dtype], b, hk, hv, dk, dv,
                                      *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], g.data_ptr(),
                                      beta.data_ptr(), states.data_ptr(), slots.data_ptr(), out.data_ptr(),
                                      kernel_threads())
    return out if status == 0 else None


def native_causal_conv(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
                       conv_state: torch.Tensor) -> torch.Tensor | None:
    """reference_causal_conv in one native call: x (any row stride, C contiguous), weight and
    conv_state contiguous, all of one kernel dtype."""
    t, c = x.shape
    if not (_rows(x) and weight.dtype == conv_state.dtype == x.dtype and weight.is_contiguous()
            and conv_state.is_contiguous() and weight.shape[0] == c and conv_state.shape == (c, weight.shape[1] - 1)):
        return None
    out = torch.empty(t, c, dtype=x.dtype)
    status = lib.qvl_causal_conv(x.data_ptr(), DTYPES[x.dtype], t, c, x.stride(0), weight.data_ptr(), weight.shape[1],
                                 conv_state.data_ptr(), out.data_ptr(), kernel_threads())
    return out if status == 0 else None


def native_causal_conv_step(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                            slots: torch.Tensor) -> torch.Tensor | None:
    """reference_causal_conv_step in one native call."""
    b, c = x.shape
    if not (_rows(x) and weight.dtype == conv_states.dtype == x.dtype and weight.is_contiguous()
            and conv_states.is_contiguous() and weight.shape[0] == c
            and conv_states.shape[1:] == (c, weight.shape[1] - 1)):
        return None
    slots = _check_slots(slots, conv_states.shape[0], b, "causal conv step")
    out = torch.empty(b, c, dtype=x.dtype)
    status = lib.qvl_causal_conv_step(x.data_ptr(), DTYPES[x.dtype], b, c, x.stride(0), weight.data_ptr(),
                                      weight.shape[1], conv_states.data_ptr(), slots.data_ptr(), out.data_ptr(),
                                      kernel_threads())
    return out if status == 0 else None
