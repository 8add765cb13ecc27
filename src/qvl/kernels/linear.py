"""ctypes bindings of the linear products: the GEMV (a few rows: decoding), the many-row int8
and int4 kernels (16-bit pairs, byte products, AMX tiles), the int8 x int8 product around oneDNN's int8
GEMM, and dequantisation. Each takes the library as its first argument and returns None where
it does not take the inputs (the caller then runs torch's product)."""

from __future__ import annotations

import ctypes
import functools

import torch

from qvl.kernels.build import DTYPES, W_INT4, W_INT8, address
from qvl.threads import kernel_threads

ACTIVATION_GROUP = 64  # columns per scale of the byte kernel's activation codes (prefill, int4)
VISION_ACTIVATION_GROUP = 256  # the vision tower's 8-bit codes (smoothed: coarser groups cost it nothing measurable)
AMX_BF16_MAX_VALUES = 1 << 21  # amx_gemm.c's MAX_ACTIVATIONS
INT8_SUM_MAX_COLUMNS = 65536  # the AMX int8 kernels' int32 sums stay exact up to this many columns
_K_STEP = {"i16_linear": 2, "q8_linear": 4, "amx_i16_linear": 64}  # the many-row int8 kernels' column steps


def int8_kernel_takes(name: str, n: int, k: int) -> bool:
    """Whether the many-row int8 kernel `name` (i16_linear, q8_linear, amx_i16_linear) takes a
    weight [n, k]."""
    return k % _K_STEP[name] == 0 and n % 16 == 0 and (name != "amx_i16_linear" or k <= INT8_SUM_MAX_COLUMNS)


def int4_kernel_takes(n: int, k: int, group_size: int) -> bool:
    """Whether q4_linear takes an int4 weight [n, k] with groups of group_size inputs: whole
    activation groups (of ACTIVATION_GROUP columns) in each weight group."""
    return group_size > 0 and group_size % ACTIVATION_GROUP == 0 and k % group_size == 0 and n % 16 == 0


def amx_bf16_takes(n: int, k: int, group_size: int = 0, int4: bool = False) -> bool:
    """Whether amx_bf16_linear takes an int8 weight [n, k] (int4: with groups of group_size)."""
    return k % 32 == 0 and n % 32 == 0 and (not int4 or (group_size > 0 and group_size % 32 == 0))


def amx_tiles_take(n: int, k: int) -> bool:
    """Whether int8_matmul's AMX kernel takes a weight [n, k] (amx_pack_int8)."""
    return n % 16 == 0 and k <= INT8_SUM_MAX_COLUMNS


def gemv(lib: ctypes.CDLL, kind: int, x: torch.Tensor, weight: torch.Tensor, out_features: int,
         scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, group_size: int = 0,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32/bf16 @ the bf16/int8/int4 (`kind`) weight's transpose (+ bias) ->
    [..., out_features] in x's dtype, streaming the weight once (a few rows: decoding). Float
    arguments (scale, zero, bias) must have x's dtype; every tensor must be contiguous."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    status = lib.qvl_linear(kind, rows.data_ptr(), DTYPES[x.dtype], rows.shape[0], k, out_features,
                            weight.data_ptr(), address(scale), address(zero), group_size, address(bias), y.data_ptr(),
                            kernel_threads())
    if status != 0:
        raise MemoryError("qvl_linear could not allocate its activation buffers")
    return y.view(*x.shape[:-1], out_features)


def amx_bf16_linear(lib: ctypes.CDLL, kind: int, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor | None = None, group_size: int = 0,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 @ the int8 (W_INT8: [N, K], a scale per row) or int4 (W_INT4: nibbles
    [N, K/2], a scale and a zero per group) weight's transpose (+ bias) -> [..., N] bf16 on AMX
    tiles, the weight converted to bf16 panel by panel (many rows: prefill); None where the
    kernel does not run (no AMX, K or N not a multiple of 32, int4 groups not a multiple of 32,
    more than 2^21 activation values, tensors not contiguous or scale/zero/bias dtypes apart)."""
    k, n = x.shape[-1], weight.shape[0]
    if x.numel() > AMX_BF16_MAX_VALUES or not weight.is_contiguous() or not amx_bf16_takes(n, k, group_size,
                                                                                         kind == W_INT4):
        return None
    if kind == W_INT4 and zero is None:
        return None
    if not all(t is None or (t.dtype == scale.dtype and t.is_contiguous()) for t in (scale, zero, bias)):
        return None  # the kernel reads them as one contiguous dtype
    assert x.dtype == torch.bfloat16 and weight.dtype == (torch.int8 if kind == W_INT8 else torch.uint8)
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    status = lib.qvl_amx_bf16_linear(kind, rows.data_ptr(), rows.shape[0], k, n, weight.data_ptr(), scale.data_ptr(),
                                     address(zero), group_size, address(bias), DTYPES[scale.dtype], y.data_ptr(),
                                     kernel_threads())
    return y.view(*x.shape[:-1], n) if status == 1 else None


def amx_i16_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 @ (weight [N, K] int8 * scale [N]).T (+ bias) -> [..., N] on AMX int8
    tiles, x in 16-bit codes per row (amx_gemm.c's qvl_amx_i16_linear); None where that kernel does
    not run (no AMX tiles, K not a multiple of 64, N not a multiple of 16)."""
    return _int8_rows(lib, "amx_i16_linear", x, weight, scale, bias, (torch.bfloat16,))


LayerNormArgs = tuple[torch.Tensor, "torch.Tensor | None", float]  # weight [K], bias [K] or None, eps


def _fusions(x: torch.Tensor, n: int, residual: torch.Tensor | None, layer_norm: LayerNormArgs | None):
    """A fused product's layer norm (x [..., K] normalised before its product: weight and bias
    in x's dtype) and residual ([..., n] in x's dtype, added to its result), checked and made
    contiguous: (norm weight or None, norm bias or None, eps, residual as [rows, n] or None)."""
    k = x.shape[-1]
    norm_w, norm_b, eps = None, None, 0.0
    if layer_norm is not None:
        norm_w, norm_b, eps = layer_norm
        if norm_w.dtype != x.dtype or norm_w.shape != (k,) or (
                norm_b is not None and (norm_b.dtype != x.dtype or norm_b.shape != (k,))):
            raise ValueError(f"the layer norm's weight {tuple(norm_w.shape)} {norm_w.dtype} does not suit rows of "
                             f"{k} {x.dtype}")
        norm_w, norm_b = norm_w.contiguous(), None if norm_b is None else norm_b.contiguous()
    if residual is not None:
        if residual.dtype != x.dtype or residual.shape != (*x.shape[:-1], n):
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match the product's "
                             f"{(*x.shape[:-1], n)} {x.dtype}")
        residual = residual.reshape(-1, n).contiguous()
    return norm_w, norm_b, float(eps), residual


def i16_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ (weight [N, K] int8 * scale [N]).T (+ bias) -> [..., N] with x in 16-bit
    codes per row, on AVX-512 or AVX2 integer pair products (prefill_gemm.c's qvl_i16_linear);
    None where that kernel does not run (other tiers, K odd, N not a multiple of 16)."""
    return _int8_rows(lib, "i16_linear", x, weight, scale, bias, tuple(DTYPES))


def q8_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, group: int = ACTIVATION_GROUP, gelu_tanh: bool = False,
              residual: torch.Tensor | None = None, layer_norm: LayerNormArgs | None = None) -> torch.Tensor | None:
    """x [..., K] @ (weight [N, K] int8 * scale [N]).T (+ bias) -> [..., N] with x in 8-bit
    codes per `group` columns, on byte products (prefill_gemm.c's qvl_q8_linear: VNNI, ARM's sdot or
    i8mm); None where that kernel does not run (no such products, K or the group not a multiple
    of 4 (of 8 with i8mm), N not a multiple of 16).
    `layer_norm`, `gelu_tanh` and `residual` are fused into it as int8_matmul's are."""
    norm_w, norm_b, eps, residual = _fusions(x, scale.shape[0], residual, layer_norm)
    return _int8_rows(lib, "q8_linear", x, weight, scale, bias, tuple(DTYPES), group, address(norm_w),
                      address(norm_b), eps, int(gelu_tanh), address(residual))


def q4_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ the int4 weight's transpose (nibbles [N, K/2], scale and zero [N, K/g]:
    (q - 8) * scale + zero) (+ bias) -> [..., N] with x in 8-bit codes per ACTIVATION_GROUP
    columns, the same codes as q8_linear's, on byte products (byte_gemm.c's qvl_q4_linear: the
    nibbles unpacked as each tile's weights are laid out, each group's scale and zero folded into
    the rescale); None where that kernel does not run (no byte products, int4_kernel_takes says
    no, the tensors' dtypes or shapes apart)."""
    k, n = x.shape[-1], weight.shape[0]
    if x.dtype not in DTYPES or not int4_kernel_takes(n, k, group_size) or weight.dtype != torch.uint8 or \
            weight.shape[1] * 2 != k or not weight.is_contiguous():
        return None
    if not all(t is not None and t.dtype == x.dtype and t.is_contiguous() and t.shape == (n, k // group_size)
               for t in (scale, zero)) or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()
                                                                 or bias.numel() != n)):
        return None
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype)
    status = lib.qvl_q4_linear(rows.data_ptr(), DTYPES[x.dtype], rows.shape[0], k, n, weight.data_ptr(),
                               scale.data_ptr(), zero.data_ptr(), group_size, address(bias), y.data_ptr(),
                               kernel_threads(), ACTIVATION_GROUP)
    if status == -1:
        raise MemoryError("qvl_q4_linear could not allocate its activation codes")
    return y.view(*x.shape[:-1], n) if status == 0 else None


def _int8_rows(lib: ctypes.CDLL, name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, dtypes: tuple[torch.dtype, ...], *extra) -> torch.Tensor | None:
    """The many-row int8 kernel qvl_`name`, taking (x, dt, M, K, N, w, scale, bias, y, threads, *extra):
    None for shapes or dtypes it does not take (scale and bias must be x's dtype), or when it says -2."""
    k, n = x.shape[-1], weight.shape[0]
    if x.dtype not in dtypes or not int8_kernel_takes(name, n, k) or weight.dtype != torch.int8 or weight.shape[1] != k:
        return None
    if not weight.is_contiguous() or scale.dtype != x.dtype or not scale.is_contiguous() or scale.numel() != n or (
            bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != n)):
        return None
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype)
    kernel = getattr(lib, f"qvl_{name}")
    status = kernel(rows.data_ptr(), DTYPES[x.dtype], rows.shape[0], k, n, weight.data_ptr(), scale.data_ptr(),
                    address(bias), y.data_ptr(), kernel_threads(), *extra)
    if status == -1:
        raise MemoryError(f"qvl_{name} could not allocate its activation codes")
    return y.view(*x.shape[:-1], n) if status == 0 else None


def dequantize(lib: ctypes.CDLL, kind: int, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               group_size: int, shape: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """An int8/int4 weight -> [N, K] in the scales' dtype (into `out`, contiguous, when
    given), in one multi-threaded pass."""
    if out is None:
        out = torch.empty(shape, dtype=scale.dtype)
    lib.qvl_dequantize(kind, weight.data_ptr(), scale.data_ptr(), address(zero), group_size, shape[0], shape[1],
                       DTYPES[scale.dtype], out.data_ptr(), kernel_threads())
    return out


# int8_matmul runs oneDNN's GEMM on blocks of rows whose float32 product fits 8 MB (rescaled
# while in cache), never fewer than 256 rows (the per-call cost): docs/decisions/int8-activations.md
INT8_GEMM_OUTPUT_FLOATS = 2 << 20
INT8_GEMM_MIN_ROWS = 256


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 -> oneDNN's prepacked copy of it for int8_gemm (an opaque tensor)."""
    return torch.ops.onednn.qlinear_prepack(weight, None)


def amx_pack_int8(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 (N % 16 == 0) -> its AMX tiles for int8_matmul(amx=True): [N, Kp] int8,
    K zero-padded to Kp, a multiple of 64 (amx_gemm.c's qvl_amx_pack_int8 layout)."""
    n, k = weight.shape
    if n % 16:
        raise ValueError(f"AMX int8 tiles take weights of a multiple of 16 rows, not {n}")
    weight = weight.contiguous()
    packed = torch.empty(n, -(-k // 64) * 64, dtype=torch.int8)
    lib.qvl_amx_pack_int8(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def int8_gemm(codes: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """codes [M, K] uint8 @ the packed int8 weight [N, K].T -> [M, N] float32: oneDNN's int8
    GEMM (VNNI, AMX tiles or vpmaddubsw), the integer sums exact below 2^24."""
    ones, zeros = _unit_weight_scales(n)
    return torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32, "none",
                                              [], "")


@functools.lru_cache(maxsize=64)
def _unit_weight_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales of 1 and zero points of 0 for n output channels (int8_gemm scales afterwards),
    made once per width instead of per call; the op only reads them."""
    return torch.ones(n), torch.zeros(n, dtype=torch.long)


def int8_matmul(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, colsums: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, levels: int, gelu_tanh: bool = False,
                residual: torch.Tensor | None = None, layer_norm: LayerNormArgs | None = None,
                amx: bool = False) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] int8 * scale [N]).T (+ bias), the weight given packed
    (pack_int8; amx_pack_int8 when `amx`) with its codes' sums over K (colsums [N] float32), the
    activations quantised per row to codes 0..levels over the row's range: two fused native
    passes around int8_gemm, or (amx) the quantise pass and one AMX kernel that rescales each
    block of sums while it is in cache.
    The first layer-normalises the rows first when `layer_norm` is given (its weight and bias in
    x's dtype); the second applies tanh-GELU when `gelu_tanh` (before rounding to x's dtype), and
    adds the result to `residual` ([..., N], x's dtype) when given, as `residual + product` would."""
    k, n = x.shape[-1], scale.shape[0]
    rows = x.reshape(-1, k).contiguous()
    norm_w, norm_b, eps, residual = _fusions(x, n, residual, layer_norm)
    m, threads, dt = rows.shape[0], kernel_threads(), DTYPES[x.dtype]
    # the AMX kernel reads whole tiles: rows padded to 32 and columns to 64 with zero codes
    kp = packed.shape[1] if amx else k
    codes = torch.empty(-(-m // 32) * 32 if amx else m, kp, dtype=torch.uint8)
    codes[m:] = 0
    row_scale, row_lo = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.float32)
    if lib.qvl_quantize_rows(rows.data_ptr(), dt, m, k, levels, address(norm_w), address(norm_b),
                             eps, codes.data_ptr(), kp, row_scale.data_ptr(),
                             row_lo.data_ptr(), threads) != 0:
        raise MemoryError("qvl_quantize_rows could not allocate its row buffers")
    y = torch.empty(m, n, dtype=x.dtype)
    if amx:
        status = lib.qvl_amx_int8_matmul(codes.data_ptr(), packed.data_ptr(), m, kp, n, row_scale.data_ptr(),
                                         row_lo.data_ptr(), colsums.data_ptr(), scale.data_ptr(), address(bias), dt,
                                         int(gelu_tanh), address(residual), y.data_ptr(), threads)
        if status == -1:
            raise MemoryError("qvl_amx_int8_matmul could not allocate its scale buffers")
        if status != 0:
            raise RuntimeError(f"qvl_amx_int8_matmul refused [{m}, {kp}] x [{n}, {kp}] (no AMX tiles here?)")
        return y.view(*x.shape[:-1], n)
    block = max(INT8_GEMM_MIN_ROWS, INT8_GEMM_OUTPUT_FLOATS // n)
    for r0 in range(0, m, block):  # each block's float32 product is rescaled while still in cache
        r1 = min(m, r0 + block)
        acc = int8_gemm(codes[r0:r1], packed, n)
        if lib.qvl_rescale(acc.data_ptr(), row_scale[r0:].data_ptr(), row_lo[r0:].data_ptr(), colsums.data_ptr(),
                           scale.data_ptr(), address(bias), dt, r1 - r0, n, int(gelu_tanh),
                           None if residual is None else residual[r0:].data_ptr(), y[r0:].data_ptr(), threads) != 0:
            raise MemoryError("qvl_rescale could not allocate its scale buffers")
    return y.view(*x.shape[:-1], n)

