"""The linear layers' products (qvl.quantize's modules call these): each runs the kernel its
layer's plan names for the row count, and torch's product where that kernel does not take the
inputs (dequantise + GEMM, F.linear, torch's int8 kernel)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qvl import mapped
from qvl.kernels import linear
from qvl.kernels.build import W_BF16, W_INT4, W_INT8
from qvl.kernels.library import library
from qvl.kernels.plan import PACKED, Kernel, LinearPlan

# float32 compute, up to a prefill chunk of rows: many-row products dequantise this many weight
# rows per GEMM, so each block is still in cache when the GEMM reads it (not for the vision
# tower's larger row counts, nor in bf16: docs/decisions/int8-weights.md)
DEQUANTIZED_ROWS = 1024
DEQUANTIZED_MAX_ACTIVATIONS = 512

# Many-row products dequantise each weight into one reused buffer per thread and dtype (as big as
# the largest weight) instead of a fresh allocation, whose pages the kernel would fault in on
# every product.
_scratch = threading.local()
_PROMPT = contextvars.ContextVar("qvl_prompt_products", default=False)


def scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A [shape] tensor of `dtype` in this thread's reused buffer: valid until the next call
    from this thread (for a dequantised weight that one GEMM reads, then drops)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    n = shape[0] * shape[1]
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < n:
        buffers[dtype] = buf = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


@contextlib.contextmanager
def prompt_products():
    """Products inside take their plan's `prompt_rows` limit (int8: the many-row kernels whatever
    the row count), so that a prompt token is computed the same whether it is prefilled in one
    call or in a slice of a few tokens. Decode steps stay outside."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


def kernel_for(plan: LinearPlan | None, x: torch.Tensor) -> Kernel:
    """The kernel of `plan` for x's rows (x: [..., I])."""
    if plan is None:
        raise RuntimeError("this layer has no kernel plan: give it one with qvl.kernels.plan.Plan.apply")
    rows = x.numel() // x.shape[-1]
    return plan.decode if rows <= (plan.prompt_rows if _PROMPT.get() else plan.decode_rows) else plan.prefill


def float_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A float linear layer (quantize.Bf16Linear): the bf16 GEMV where its plan says so, else F.linear."""
    if kernel_for(layer.plan, x).name == "gemv" and x.dtype == torch.bfloat16:
        return linear.gemv(library().lib, W_BF16, x, layer.weight, layer.out_features, bias=layer.bias)
    return F.linear(x, layer.weight, layer.bias)


def int8_linear(layer: nn.Module, x: torch.Tensor, gelu_tanh: bool = False, residual: torch.Tensor | None = None,
                norm: nn.LayerNorm | None = None) -> torch.Tensor:
    """quantize.Int8Linear on x [..., I] -> [..., O]: norm(x) first when given, then the product,
    tanh-GELU when gelu_tanh, residual + that when given ([..., O]). The int8 x int8 kernels fuse
    the norm into their quantise pass and the rest into their last pass over the output."""
    kernel = kernel_for(layer.plan, x)
    packed = kernel.name in PACKED
    if packed and x.dtype != layer.scales.dtype:
        raise TypeError(f"int8 x int8 products take {layer.scales.dtype} activations, not {x.dtype}")
    if packed or (kernel.name == "q8_linear" and x.dtype == layer.scales.dtype):
        if norm is not None and not (norm.weight is not None and norm.weight.dtype == x.dtype):
            x, norm = norm(x), None
        layer_norm = None if norm is None else (norm.weight, norm.bias, norm.eps)
        if packed:
            return linear.int8_matmul(library().lib, x, layer.packed, layer.colsums, layer.scales, layer.bias,
                                      (1 << kernel.code_bits) - 1, gelu_tanh, residual, layer_norm,
                                      kernel.name == "amx_int8")
        y = linear.q8_linear(library().lib, x, layer.weight, layer.scales, layer.bias, kernel.group, gelu_tanh,
                             residual, layer_norm)
        if y is not None:
            return y
    if norm is not None:
        x = norm(x)
    y = int8_product(x, layer.weight, layer.scales, layer.bias, kernel)
    y = F.gelu(y, approximate="tanh") if gelu_tanh else y
    return y if residual is None else residual + y


def int8_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 kernel: Kernel) -> torch.Tensor:
    """x [..., I] @ (weight [O, I] int8 * scales [O]).T (+ bias) -> [..., O] in `kernel`; where
    it does not take the inputs, torch's int8 kernel (the GEMV's rows) or dequantise + GEMM."""
    lib, name = library().lib, kernel.name
    if name == "gemv" and x.dtype == scales.dtype:
        return linear.gemv(lib, W_INT8, x, weight, weight.shape[0], scales, bias=bias)
    if name in ("gemv", "torch_int8"):
        y = torch._weight_int8pack_mm(x.reshape(-1, weight.shape[1]), weight, scales)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    y = None
    if name == "amx_bf16_linear":
        y = linear.amx_bf16_linear(lib, W_INT8, x, weight, scales, bias=bias)
    elif name == "q8_linear":
        y = linear.q8_linear(lib, x, weight, scales, bias, kernel.group)
    elif name in ("i16_linear", "amx_i16_linear"):
        y = getattr(linear, name)(lib, x, weight, scales, bias)
    if y is not None:
        return y
    return dequantized_product(x, weight.shape[0], lambda r: dequantize_int8(weight[r], scales[r], transient=True),
                               bias)


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 kernel: Kernel) -> torch.Tensor:
    """x [..., I] @ the int4 weight's transpose (nibbles [O, I/2], scales and zeros [O, I/g]) ->
    [..., O] in `kernel` (the GEMV, the byte kernel, AMX bf16 tiles), else dequantise + GEMM."""
    lib = library().lib
    if kernel.name == "gemv" and x.dtype == scales.dtype:
        return linear.gemv(lib, W_INT4, x, packed, packed.shape[0], scales, zeros, group_size)
    y = None
    if kernel.name == "amx_bf16_linear":
        y = linear.amx_bf16_linear(lib, W_INT4, x, packed, scales, zeros, group_size)
    elif kernel.name == "q4_linear":
        y = linear.q4_linear(lib, x, packed, scales, zeros, group_size)
    if y is not None:
        return y
    return dequantized_product(x, packed.shape[0],
                               lambda r: dequantize_int4(packed[r], scales[r], zeros[r], group_size, transient=True))


def dequantized_product(x: torch.Tensor, out_features: int, dequantize: Callable[[slice], torch.Tensor],
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., I] @ W.T (+ bias) -> [..., O] with a float GEMM, W [O, I] given by
    dequantize(slice of rows): whole, or DEQUANTIZED_ROWS rows at a time for up to
    DEQUANTIZED_MAX_ACTIVATIONS float32 rows."""
    if x.dtype != torch.float32 or out_features <= DEQUANTIZED_ROWS or \
            x.numel() // x.shape[-1] > DEQUANTIZED_MAX_ACTIVATIONS:
        return F.linear(x, dequantize(slice(None)), bias)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, DEQUANTIZED_ROWS):
        block = slice(start, start + DEQUANTIZED_ROWS)
        y[:, block] = F.linear(rows, dequantize(block), None if bias is None else bias[block])
    return y.view(*x.shape[:-1], out_features)


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None,
                    transient: bool = False) -> torch.Tensor:
    """int8 weight [O, I] (or some of its rows) with its row scales [O] -> the scales' dtype;
    `transient`: into this thread's scratch buffer (for one product's use)."""
    lib = library().lib
    if rows is None and weight.is_contiguous() and lib is not None:
        shape = tuple(weight.shape)
        return linear.dequantize(lib, W_INT8, weight, scales, None, 0, shape,
                                 scratch(shape, scales.dtype) if transient else None)
    w, s = (weight, scales) if rows is None else (weight[rows], scales[rows])
    return w.to(s.dtype) * s[..., None]


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """int4 storage [O, I/2] uint8 (even column in the low nibble) -> codes [O, I]."""
    return torch.stack([p & 0xF, p >> 4], -1).flatten(1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    rows: torch.Tensor | None = None, transient: bool = False) -> torch.Tensor:
    """int4 weight (nibbles [O, I/2], scales and zeros [O, I/g]; or some of its rows) -> the
    scales' dtype [O, I], w = (q - 8) * scale + zero; `transient`: into this thread's scratch buffer."""
    lib = library().lib
    if rows is None and packed.is_contiguous() and lib is not None:
        shape = (packed.shape[0], 2 * packed.shape[1])
        return linear.dequantize(lib, W_INT4, packed, scales, zeros, group_size, shape,
                                 scratch(shape, scales.dtype) if transient else None)
    if rows is not None:
        packed, scales, zeros = packed[rows], scales[rows], zeros[rows]
    q = unpack_nibbles(packed).view(packed.shape[0], -1, group_size)
    return (q.to(scales.dtype) - 8).mul_(scales[..., None]).add_(zeros[..., None]).view(packed.shape[0], -1)


def pack(layer: nn.Module, keep_weight: bool) -> None:
    """Give an int8 layer whose plan runs int8 x int8 on a packed weight that copy (AMX tiles or
    oneDNN's) and its codes' sums over I; `keep_weight`: the plain weight stays (a decoder layer's,
    for the GEMV), else it is dropped, its pages too when it was read from a memory-mapped file."""
    weight = layer.weight
    tiles = layer.plan.prefill.name == "amx_int8"
    layer.packed = linear.amx_pack_int8(library().lib, weight) if tiles else linear.pack_int8(weight)
    layer.colsums = weight.sum(1, dtype=torch.int32).float()
    if not keep_weight:
        mapped.release(weight)
        layer.weight = None
