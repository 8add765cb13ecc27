"""ctypes bindings of the element-wise kernels: RMSNorm, SiLU * up, and the text and vision
rotary embeddings, each in one pass rounded as the reference rounds."""

from __future__ import annotations

import ctypes

import torch

from qvl.kernels.build import DTYPES
from qvl.threads import kernel_threads


def vision_rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """The vision tower's rotary embedding in one pass (AVX512-BF16 builds): x [N, H, D] bf16
    (any row/head strides, D contiguous), cos/sin [N, 1, D] float32 -> [N, H, D] bf16
    contiguous, as the reference rounds it (float32 throughout, one rounding). None when the
    shapes do not apply."""
    n, h, d = x.shape
    if x.dtype != torch.bfloat16 or x.stride(2) != 1:
        return None
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.numel() != n * d or sin.numel() != n * d:
        return None
    cos, sin = cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous()
    out = torch.empty(n, h, d, dtype=torch.bfloat16)
    status = lib.qvl_vision_rope(x.data_ptr(), x.stride(0), x.stride(1), n, h, d, cos.data_ptr(), sin.data_ptr(),
                                 out.data_ptr(), kernel_threads())
    return out if status == 0 else None


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x (bf16 or float32) with a weight of the same dtype, in one
    call (the reference runs seven small ops); zero_centred: scaling by (1 + weight), rounded once."""
    rows = x.contiguous()
    out = torch.empty_like(rows)
    kernel = lib.qvl_rmsnorm_zero_centred if zero_centred else lib.qvl_rmsnorm
    kernel(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), DTYPES[x.dtype], rows.numel() // rows.shape[-1],
           rows.shape[-1], eps, kernel_threads())
    return out


def gated_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x times silu(gate) (x, gate: the same shape; all three one
    dtype, bf16 or float32), in one pass rounded as the reference module rounds."""
    rows, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(rows)
    lib.qvl_gated_rmsnorm(rows.data_ptr(), gate.data_ptr(), weight.data_ptr(), out.data_ptr(), DTYPES[x.dtype],
                          rows.numel() // rows.shape[-1], rows.shape[-1], eps, kernel_threads())
    return out


def silu_mul(lib: ctypes.CDLL, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u (bf16 or float32, the same shape), rounded as the reference rounds it (after
    the SiLU and after the product), in one pass; returns g's storage (overwritten) when g is
    contiguous, else a new tensor."""
    if g.shape != u.shape or g.dtype != u.dtype or g.dtype not in DTYPES:
        raise ValueError(f"silu_mul takes two tensors of one shape and dtype, not {tuple(g.shape)} {g.dtype} and "
                         f"{tuple(u.shape)} {u.dtype}")
    g, u = g.contiguous(), u.contiguous()
    lib.qvl_silu_mul(g.data_ptr(), u.data_ptr(), DTYPES[g.dtype], g.numel(), kernel_threads())
    return g


def text_rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Prefill's rotary embedding of one row: x [1, H, T, D] (any head/token strides, D
    contiguous), cos/sin [1, 1, T, D] of x's dtype -> x * cos + rotate_half(x) * sin as [1, H, T, D]
    (a view of a [T, H, D] tensor), rounded as the reference rounds it. None when the shapes or
    dtypes do not apply."""
    b, h, t, d = x.shape
    if b != 1 or x.stride(3) != 1 or x.dtype not in DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    if cos.numel() != t * d or sin.numel() != t * d:
        return None
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    out = torch.empty(t, h, d, dtype=x.dtype)
    if lib.qvl_text_rope(x.data_ptr(), DTYPES[x.dtype], t, h, d, x.stride(2), x.stride(1), cos.data_ptr(),
                         sin.data_ptr(), out.data_ptr(), kernel_threads()) != 0:
        return None
    return out.transpose(0, 1)[None]

