"""Weight-only int8 / int4 quantisation as a module swap, and the linear layers' kernels.

int8: symmetric, one scale per output channel. int4: asymmetric min/max per group of
`group_size` inputs, two codes per byte. Decoding (a few activation rows) runs qvl's
native kernels (native.py), which stream the weights at the machine's memory bandwidth;
prefill and vision (many rows) dequantise one matrix at a time and run the dtype's GEMM
(oneDNN). Without the native kernels, int8 decoding uses torch's `_weight_int8pack_mm`
and int4 the dequantised GEMM.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qvl import mapped, native
from qvl.dispatch import kernels

WEIGHT_FORMATS = ("bf16", "fp32", "int8", "int4")
KERNEL_MAX_ROWS = native.GEMV_MAX_ROWS
# float32 compute, up to a prefill chunk of rows: many-row products dequantise this many weight
# rows per GEMM, so each block is still in cache when the GEMM reads it (prefill's MLP 1.25-1.4x
# faster on AVX2 and AVX-512; not for vision's 1008 rows, nor on bf16 tiers, where oneDNN's
# per-call cost outweighs it: docs/benchmarks.md, section 21)
DEQUANTIZED_ROWS = 1024
DEQUANTIZED_MAX_ACTIVATIONS = 512


SMOOTHING = ("none", "data-free", "calibrated")

# Many-row products dequantise each weight into one reused buffer per thread and dtype (as big
# as the largest weight, e.g. 25 MB for 2B's MLP in bf16) instead of a fresh allocation, whose
# pages the kernel would fault in on every product: first token 3% sooner (docs/benchmarks.md,
# section 28).
_scratch = threading.local()


def scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A [shape] tensor of `dtype` in this thread's reused buffer: valid until the next call
    from this thread (for a dequantised weight that one GEMM reads, then drops)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    n = shape[0] * shape[1]
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < n:
        buffers[dtype] = buf = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


@dataclass(frozen=True)
class QuantSpec:
    weights: str  # "int8" | "int4"
    group_size: int = 128
    vision: bool = False  # also int8 for the vision tower
    # the vision tower's int8 inputs smoothed before quantising (qvl.smoothing): "data-free"
    # (from the norms) by default, "calibrated" (from images: `qvl quantize --calibrate`, files
    # only), "none" in files written before smoothing existed
    smoothing: str = "data-free"

    def __post_init__(self):
        if self.weights not in ("int8", "int4"):
            raise ValueError(f"quantised weights must be int8 or int4, not '{self.weights}'")
        if self.group_size not in (32, 64, 128, 256):
            raise ValueError("group size must be 32, 64, 128 or 256")
        if self.smoothing not in SMOOTHING:
            raise ValueError(f"smoothing must be one of {', '.join(SMOOTHING)}, not '{self.smoothing}'")
        if not self.vision:
            object.__setattr__(self, "smoothing", "none")  # only the int8 vision tower is smoothed

    def metadata(self) -> dict[str, str]:
        return {"qvl_weights": self.weights, "qvl_group_size": str(self.group_size),
                "qvl_vision_int8": str(self.vision).lower(), "qvl_smoothing": self.smoothing}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> QuantSpec | None:
        if meta.get("qvl_weights") not in ("int8", "int4"):
            return None
        return cls(meta["qvl_weights"], int(meta["qvl_group_size"]), meta.get("qvl_vision_int8") == "true",
                   meta.get("qvl_smoothing", "none"))


# -- the arithmetic -----------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [O, I] -> int8 [O, I], scales [O] float32; w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [O, I] -> codes uint8 [O, I] in 0..15, scales and zeros [O, I/g] float32;
    w ~= (q - 8) * scale + zero."""
    o, i = w.shape
    g = w.float().view(o, i // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).view(o, i)
    return q, scale, lo + 8 * scale


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 storage (in memory and in files): [O, I] codes -> [O, I/2] uint8, even column
    in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 0xF, p >> 4], -1).flatten(1)


# -- modules ------------------------------------------------------------------------------

def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


_PROMPT = contextvars.ContextVar("qvl_prompt_products", default=False)


@contextlib.contextmanager
def prompt_products():
    """int8 products inside take the many-row kernels whatever their row count, so that a
    prompt token is computed the same whether it is prefilled in one call or in a slice of a
    few tokens (the GEMV's activation codes are 16-bit per row, the many-row ones 8-bit per
    group where the CPU has VNNI, and oneDNN's or AMX's elsewhere). Decode steps stay outside."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


def _int8_gemv_rows() -> int:
    """Up to how many rows an int8 product takes the GEMV here: none inside prompt_products."""
    return 0 if _PROMPT.get() else kernels().int8_gemv_rows


def _native_product(x: torch.Tensor, kind: int, weight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None = None, group_size: int = 0, bias: torch.Tensor | None = None,
                    byte_codes: bool = False):
    """Many rows of activations times an int8/int4 weight in qvl's own kernels. bf16 on AMX:
    int8 weights on int8 tiles with the activations in 16-bit codes per row, int4 (and the
    shapes those do not take) on bf16 tiles. Elsewhere, int8 weights: with `byte_codes` where
    the CPU has VNNI or ARM's dot products, byte products with the activations in 8-bit codes
    per native.ACTIVATION_GROUP columns (dispatch.Kernels.group_codes); else on x86 16-bit pair
    products, the activations in 16-bit codes per row (dispatch.Kernels.i16_products). None where none
    runs (dequantise + GEMM then)."""
    k = kernels()
    if x.dtype == torch.bfloat16 and k.has(native.AMX_INT8):
        if kind == native.W_INT8 and (y := native.amx_i16_linear(k.lib, x, weight, scales, bias)) is not None:
            return y
        return native.amx_bf16_linear(k.lib, kind, x, weight, scales, zeros, group_size, bias)
    if kind == native.W_INT8 and byte_codes and k.group_codes(x.dtype) and (
            y := native.q8_linear(k.lib, x, weight, scales, bias)) is not None:
        return y
    if kind == native.W_INT8 and k.i16_products(x.dtype):
        return native.i16_linear(k.lib, x, weight, scales, bias)
    return None


def _gemv_library(x: torch.Tensor, dtype: torch.dtype, max_rows: int = KERNEL_MAX_ROWS):
    """The native library when x is few rows (up to max_rows) of the layer's float dtype, else None."""
    if _rows(x) > max_rows or x.dtype != dtype or not (k := kernels()).gemv(dtype):
        return None
    return k.lib


class Bf16Linear(nn.Linear):
    """nn.Linear (same parameters) whose decoding products run the native bf16 GEMV:
    oneDNN's reads the weights at about half the memory bandwidth."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = _gemv_library(x, torch.bfloat16) if self.weight.dtype == torch.bfloat16 else None
        if lib is None:
            return F.linear(x, self.weight, self.bias)
        return native.linear(lib, native.W_BF16, x, self.weight, self.out_features, bias=self.bias)

    def native_args(self) -> native.LinearArgs | None:
        """This layer for the one-call decode step (bf16 weights)."""
        if self.weight.dtype != torch.bfloat16:
            return None
        return native.LinearArgs.of(native.W_BF16, self.out_features, self.in_features, self.weight, bias=self.bias)


class Bf16StoredLinear(nn.Linear):
    """A float32-compute linear whose weight stays bf16 in memory, as the checkpoint stores it:
    on CPUs without bf16 products the vision tower keeps the memory it has elsewhere (0.8 GB
    instead of 1.6 GB for 2B); each product first upcasts its one matrix (a few MB)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)


def keep_bf16_storage(model: nn.Module) -> set[str]:
    """Make the vision tower's float linears Bf16StoredLinear; returns their weights' names."""
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear and name.startswith("visual.")]
    for name in names:
        model.get_submodule(name).__class__ = Bf16StoredLinear
    return {f"{name}.weight" for name in names}


class Int8Linear(nn.Module):
    """int8 weights. Many-row products (prefill, vision) dequantise and run the float GEMM;
    with `byte_codes` (VNNI or ARM's dot products, and no AMX for the dtype) they run qvl's byte
    products with the activations in 8-bit codes per group of columns (native.q8_linear); or,
    once packed (`pack`), they quantise the activations per row and run oneDNN's int8 x int8
    GEMM (2.2-3.4x the float32 GEMM with VNNI or AVX-VNNI, 1.5-1.7x on plain AVX2) or AMX's
    int8 tiles (1.7x bf16). The last two are slightly less exact than the float GEMM."""

    fuses_gelu_tanh = True  # forward(x, gelu_tanh=True): see vision.linear_gelu_tanh
    fuses_residual = True  # forward(x, residual=r) = r + forward(x): see vision.residual_linear
    fuses_layer_norm = True  # forward(x, norm=n) = forward(n(x)) for an nn.LayerNorm n: see vision.norm_linear
    packed: torch.Tensor | None = None  # the weight for int8 x int8 products: AMX tiles or oneDNN's copy
    amx = False  # packed holds AMX tiles (dispatch.Kernels.int8_tiles)
    byte_codes = False  # many-row products take 8-bit activation codes per group (dispatch.Kernels.group_codes)
    colsums: torch.Tensor | None = None  # [O] float32: the weight codes' sums over I
    levels = 0  # activation codes 0..levels (dispatch.Kernels.int8_levels)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    @property
    def int8_activations(self) -> bool:
        """Its many-row products run int8 x int8 (oneDNN's GEMM or AMX tiles, or byte products)."""
        return self.packed is not None or self.byte_codes

    def pack(self, levels: int, keep_weight: bool) -> None:
        """Run many-row products int8 x int8 from now on, activations in codes 0..levels.
        `keep_weight`: the plain weight stays too (a decoder layer's, for the decode kernels);
        else it is dropped (the vision tower's: only the packed copy is used), its pages too
        when it was read from a memory-mapped file."""
        k = kernels()
        self.amx = k.int8_tiles(self.out_features, self.in_features)
        self.packed = native.amx_pack_int8(k.lib, self.weight) if self.amx else native.pack_int8(self.weight)
        self.levels = levels
        self.colsums = self.weight.sum(1, dtype=torch.int32).float()
        if not keep_weight:
            mapped.release(self.weight)
            self.weight = None

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or some of its rows) in the compute dtype."""
        return dequantize_int8(self.weight, self.scales, rows)

    def forward(self, x: torch.Tensor, gelu_tanh: bool = False, residual: torch.Tensor | None = None,
                norm: nn.LayerNorm | None = None) -> torch.Tensor:
        # x: [..., I] -> [..., O]: norm(x) first when given, then the product, tanh-GELU when
        # gelu_tanh, residual + that when given ([..., O]); the int8 x int8 path fuses the norm
        # into its quantise pass and the rest into its rescale pass
        many = _rows(x) > _int8_gemv_rows()
        packed = self.packed is not None and (self.weight is None or many)
        if packed and x.dtype != self.scales.dtype:
            raise TypeError(f"int8 x int8 products take {self.scales.dtype} activations, not {x.dtype}")
        if packed or (self.byte_codes and many and x.dtype == self.scales.dtype and kernels().group_codes(x.dtype)):
            if norm is not None and not (norm.weight is not None and norm.weight.dtype == x.dtype):
                x, norm = norm(x), None
            layer_norm = None if norm is None else (norm.weight, norm.bias, norm.eps)
            if packed:
                return native.int8_matmul(kernels().lib, x, self.packed, self.colsums, self.scales, self.bias,
                                          self.levels, gelu_tanh, residual, layer_norm, self.amx)
            y = native.q8_linear(kernels().lib, x, self.weight, self.scales, self.bias, gelu_tanh=gelu_tanh,
                                 residual=residual, layer_norm=layer_norm)
            if y is not None:
                return y
        if norm is not None:
            x = norm(x)
        y = self._product(x)
        y = F.gelu(y, approximate="tanh") if gelu_tanh else y
        return y if residual is None else residual + y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight, self.scales, self.bias, self.byte_codes)

    def native_args(self) -> native.LinearArgs | None:
        if self.scales.dtype not in (torch.bfloat16, torch.float32):
            return None
        return native.LinearArgs.of(native.W_INT8, self.out_features, self.in_features, self.weight, self.scales,
                                    bias=self.bias)


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None,
                    transient: bool = False) -> torch.Tensor:
    """int8 weight [O, I] (or some of its rows) with its row scales [O] -> the scales' dtype;
    `transient`: into this thread's scratch buffer (for one product's use)."""
    if rows is None and weight.is_contiguous() and (k := kernels()).dequantize():
        shape = tuple(weight.shape)
        return native.dequantize(k.lib, native.W_INT8, weight, scales, None, 0, shape,
                                 scratch(shape, scales.dtype) if transient else None)
    w, s = (weight, scales) if rows is None else (weight[rows], scales[rows])
    return w.to(s.dtype) * s[..., None]


def int8_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, byte_codes: bool = False) -> torch.Tensor:
    """x [..., I] @ (weight [O, I] int8 * scales [O]).T (+ bias) -> [..., O]: for many rows qvl's
    integer kernels (AMX tiles; elsewhere 8-bit codes per group with `byte_codes` where the CPU
    has VNNI or ARM's dot products, else on x86 16-bit pairs) or dequantise + GEMM, the native GEMV for few, torch's
    int8 kernel where the native one does not run."""
    if _rows(x) > (max_rows := _int8_gemv_rows()):
        if (y := _native_product(x, native.W_INT8, weight, scales, bias=bias, byte_codes=byte_codes)) is not None:
            return y
        return dequantized_product(x, weight.shape[0], lambda r: dequantize_int8(weight[r], scales[r], transient=True),
                                   bias)
    if (lib := _gemv_library(x, scales.dtype, max_rows)) is not None:
        return native.linear(lib, native.W_INT8, x, weight, weight.shape[0], scales, bias=bias)
    y = torch._weight_int8pack_mm(x.reshape(-1, weight.shape[1]), weight, scales).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Int8Experts(nn.Module):
    """A mixture's experts with int8 weights, one scale per output row of each expert, stored
    output-major as linears are: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I], scales [E, 2I] and [E, H]. A call reads only its expert's matrices: memory-mapped
    from the quantised-weights cache, the experts never chosen are never read."""

    byte_codes = False  # as Int8Linear's

    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("gate_up_proj", torch.empty(experts, 2 * inter, hidden, dtype=torch.int8))
        self.register_buffer("gate_up_proj_scales", torch.empty(experts, 2 * inter, dtype=dtype))
        self.register_buffer("down_proj", torch.empty(experts, hidden, inter, dtype=torch.int8))
        self.register_buffer("down_proj_scales", torch.empty(experts, hidden, dtype=dtype))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, H] tokens routed to `expert` -> [n, H]
        gate, up = int8_product(x, self.gate_up_proj[expert], self.gate_up_proj_scales[expert],
                                byte_codes=self.byte_codes).chunk(2, dim=-1)
        return int8_product(F.silu(gate) * up, self.down_proj[expert], self.down_proj_scales[expert],
                            byte_codes=self.byte_codes)

    def native_args(self, expert: int) -> tuple[native.LinearArgs, native.LinearArgs]:
        """The expert's gate_up and down linears for the one-call decode step."""
        return tuple(native.LinearArgs.of(native.W_INT8, w.shape[1], w.shape[2], w[expert], s[expert])
                     for w, s in ((self.gate_up_proj, self.gate_up_proj_scales),
                                  (self.down_proj, self.down_proj_scales)))

    def state(self, name: str, leaf: str, tensor: torch.Tensor, dtype: torch.dtype,
              stored: bool) -> dict[str, torch.Tensor]:
        """Module state for one checkpoint tensor: a published float expert tensor ([E, H, 2I] or
        [E, I, H]) quantised per expert and output row; `stored`: a file qvl wrote, holding
        the buffers as they are."""
        if stored:
            return {f"{name}.{leaf}": _aligned(tensor) if tensor.dtype == torch.int8 else tensor.to(dtype)}
        quantized = [quantize_int8(w) for w in tensor.transpose(1, 2)]  # each [out, in]
        return {f"{name}.{leaf}": torch.stack([q for q, _ in quantized]),
                f"{name}.{leaf}_scales": torch.stack([s for _, s in quantized]).to(dtype)}


def int8_linear(linear: nn.Linear, dtype: torch.dtype) -> Int8Linear:
    """A loaded float linear quantised to an Int8Linear with scales (and bias) in `dtype`."""
    new = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype)
    new.weight, scale = quantize_int8(linear.weight.detach())
    new.scales = scale.to(dtype)
    if linear.bias is not None:
        new.bias = linear.bias.detach().to(dtype)
    return new


def quantize_vision(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Replace the vision tower's loaded float linears by Int8Linear (after smoothing); returns their names."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith("visual.")]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, int8_linear(getattr(parent, attr), dtype))
    return names


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    rows: torch.Tensor | None = None, transient: bool = False) -> torch.Tensor:
    """int4 weight (nibbles [O, I/2], scales and zeros [O, I/g]; or some of its rows) -> the
    scales' dtype [O, I]; `transient`: into this thread's scratch buffer."""
    if rows is None and packed.is_contiguous() and (k := kernels()).dequantize():
        shape = (packed.shape[0], 2 * packed.shape[1])
        return native.dequantize(k.lib, native.W_INT4, packed, scales, zeros, group_size, shape,
                                 scratch(shape, scales.dtype) if transient else None)
    if rows is not None:
        packed, scales, zeros = packed[rows], scales[rows], zeros[rows]
    q = unpack_nibbles(packed).view(packed.shape[0], -1, group_size)
    return (q.to(scales.dtype) - 8).mul_(scales[..., None]).add_(zeros[..., None]).view(packed.shape[0], -1)


def int4_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x [..., I] @ the int4 weight's transpose -> [..., O]: the native GEMV for few rows,
    dequantise + GEMM otherwise."""
    if (lib := _gemv_library(x, scales.dtype)) is None:
        if (y := _native_product(x, native.W_INT4, packed, scales, zeros, group_size)) is not None:
            return y
        return dequantized_product(x, packed.shape[0],
                                   lambda r: dequantize_int4(packed[r], scales[r], zeros[r], group_size,
                                                             transient=True))
    return native.linear(lib, native.W_INT4, x, packed, packed.shape[0], scales, zeros, group_size)


def dequantized_product(x: torch.Tensor, out_features: int, dequantize, bias: torch.Tensor | None = None):
    """x [..., I] @ W.T (+ bias) -> [..., O] with a float GEMM, W [O, I] given by
    dequantize(slice of rows): whole, or DEQUANTIZED_ROWS rows at a time for up to
    DEQUANTIZED_MAX_ACTIVATIONS float32 rows (see DEQUANTIZED_ROWS)."""
    if x.dtype != torch.float32 or out_features <= DEQUANTIZED_ROWS or _rows(x) > DEQUANTIZED_MAX_ACTIVATIONS:
        return F.linear(x, dequantize(slice(None)), bias)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, DEQUANTIZED_ROWS):
        block = slice(start, start + DEQUANTIZED_ROWS)
        y[:, block] = F.linear(rows, dequantize(block), None if bias is None else bias[block])
    return y.view(*x.shape[:-1], out_features)


class Int4Experts(nn.Module):
    """A mixture's experts with int4 weights (as Int4Linear: nibbles, a scale and a zero per
    group of `group_size` inputs), output-major: gate_up_proj [E, 2I, H/2], down_proj
    [E, H, I/2], with scales and zeros per group. A call reads only its expert's matrices."""

    def __init__(self, experts: int, hidden: int, inter: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.group_size = group_size
        for leaf, out, inp in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            self.register_buffer(leaf, torch.empty(experts, out, inp // 2, dtype=torch.uint8))
            self.register_buffer(f"{leaf}_scales", torch.empty(experts, out, inp // group_size, dtype=dtype))
            self.register_buffer(f"{leaf}_zeros", torch.empty(experts, out, inp // group_size, dtype=dtype))

    def _product(self, x: torch.Tensor, leaf: str, expert: int) -> torch.Tensor:
        return int4_product(x, getattr(self, leaf)[expert], getattr(self, f"{leaf}_scales")[expert],
                            getattr(self, f"{leaf}_zeros")[expert], self.group_size)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, H] tokens routed to `expert` -> [n, H]
        gate, up = self._product(x, "gate_up_proj", expert).chunk(2, dim=-1)
        return self._product(F.silu(gate) * up, "down_proj", expert)

    def native_args(self, expert: int) -> tuple[native.LinearArgs, native.LinearArgs]:
        """The expert's gate_up and down linears for the one-call decode step."""
        def linear(leaf: str) -> native.LinearArgs:
            w = getattr(self, leaf)
            return native.LinearArgs.of(native.W_INT4, w.shape[1], 2 * w.shape[2], w[expert],
                                        getattr(self, f"{leaf}_scales")[expert], getattr(self, f"{leaf}_zeros")[expert],
                                        self.group_size)

        return linear("gate_up_proj"), linear("down_proj")

    def state(self, name: str, leaf: str, tensor: torch.Tensor, dtype: torch.dtype,
              stored: bool) -> dict[str, torch.Tensor]:
        """As Int8Experts.state, in int4."""
        if stored:
            return {f"{name}.{leaf}": _aligned(tensor) if tensor.dtype == torch.uint8 else tensor.to(dtype)}
        quantized = [quantize_int4(w, self.group_size) for w in tensor.transpose(1, 2)]  # each [out, in]
        return {f"{name}.{leaf}": torch.stack([pack_nibbles(q) for q, _, _ in quantized]),
                f"{name}.{leaf}_scales": torch.stack([s for _, s, _ in quantized]).to(dtype),
                f"{name}.{leaf}_zeros": torch.stack([z for _, _, z in quantized]).to(dtype)}


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=dtype))

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_int4(self.weight, self.scales, self.zeros, self.group_size, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_product(x, self.weight, self.scales, self.zeros, self.group_size)

    def native_args(self) -> native.LinearArgs | None:
        if self.scales.dtype not in (torch.bfloat16, torch.float32):
            return None
        return native.LinearArgs.of(native.W_INT4, self.out_features, self.in_features, self.weight, self.scales,
                                    self.zeros, self.group_size)


class TiedQuantEmbedding(nn.Module):
    """Token embeddings read from a quantised lm_head that shares their weights."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = [head]  # a list, so the head is not registered (and saved) twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()
        return self.head[0].dequantized(flat).view(*ids.shape, -1)


# -- building a quantised model -----------------------------------------------------------

def quantized_linear_names(model: nn.Module, spec: QuantSpec) -> list[str]:
    """Module names that the spec quantises: every text-decoder linear and the lm_head,
    plus the vision tower's linears when spec.vision."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and (_is_text(name) or (spec.vision and name.startswith("visual.")))]


def _is_text(name: str) -> bool:
    """The text decoder's linears and the head; not a mixture-of-experts router (`mlp.gate`),
    whose top-k choice must stay the reference's."""
    return (name.startswith("language_model.") and not name.endswith(".mlp.gate")) or name == "lm_head"


def use_decode_kernels(model: nn.Module) -> None:
    """The text decoder's float linears (those not quantised, and a mixture's router) decode
    with the native GEMV, as the one-call decode step does."""
    for name, module in model.named_modules():
        if type(module) is nn.Linear and (_is_text(name) or name.endswith(".mlp.gate")):
            module.__class__ = Bf16Linear


def swap_modules(model: nn.Module, spec: QuantSpec, dtype: torch.dtype) -> list[str]:
    """Replace the quantised linears by empty int8/int4 modules, and a mixture's experts by
    experts of the same format (int4 only where the group size divides both of their input
    sizes, else int8), before loading. Returns the replaced modules' names."""
    from qvl.model.text import Experts

    names = quantized_linear_names(model, spec)
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]
    for name, module in experts:
        parent_name, _, attr = name.rpartition(".")
        e, h, inter = module.gate_up_proj.shape[0], module.gate_up_proj.shape[1], module.gate_up_proj.shape[2] // 2
        g = spec.group_size
        int4 = spec.weights == "int4" and h % g == 0 and inter % g == 0 and g % 2 == 0
        setattr(model.get_submodule(parent_name), attr,
                Int4Experts(e, h, inter, g, dtype) if int4 else Int8Experts(e, h, inter, dtype))
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        vision = name.startswith("visual.")
        if spec.weights == "int8" or vision:
            new = Int8Linear(old.in_features, old.out_features, old.bias is not None, dtype)
        else:
            new = Int4Linear(old.in_features, old.out_features, spec.group_size, dtype)
        setattr(parent, attr, new)
    return names + [name for name, _ in experts]


def quantized_state(module: nn.Module, name: str, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A float weight [O, I] -> the module's buffers, under `name.weight` etc."""
    if isinstance(module, Int4Linear):
        q, scale, zero = quantize_int4(w, module.group_size)
        return {f"{name}.weight": pack_nibbles(q), f"{name}.scales": scale.to(dtype), f"{name}.zeros": zero.to(dtype)}
    q, scale = quantize_int8(w)
    return {f"{name}.weight": q, f"{name}.scales": scale.to(dtype)}


def portable_quantized(module: nn.Module, name: str, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A float weight [O, I] -> the tensors portable_state gives for it once loaded."""
    state = quantized_state(module, name, w, dtype)
    leaves = {"weight": "weight", "scales": "weight_scale", "zeros": "weight_zero"}
    return {f"{name}.{leaves[key.rpartition('.')[2]]}": t for key, t in state.items()}


def portable_state(module: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """A quantised module's tensors for a file: int8: weight (int8) + weight_scale;
    int4: weight (nibbles) + weight_scale + weight_zero."""
    out = {f"{name}.weight": module.weight, f"{name}.weight_scale": module.scales}
    if isinstance(module, Int4Linear):
        out[f"{name}.weight_zero"] = module.zeros
    elif module.bias is not None:
        out[f"{name}.bias"] = module.bias
    return out


def state_from_portable(module: nn.Module, name: str, tensors: dict[str, torch.Tensor],
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Inverse of portable_state (for loading a pre-quantised checkpoint): the matrices stay
    memory-mapped. torch's int8 kernel (the fallback) needs 64-byte aligned weights: files
    qvl writes are (save_aligned); tensors of other files are copied into aligned memory."""
    out = {f"{name}.weight": _aligned(tensors["weight"]), f"{name}.scales": tensors["weight_scale"].to(dtype)}
    if isinstance(module, Int4Linear):
        out[f"{name}.zeros"] = tensors["weight_zero"].to(dtype)
    elif "bias" in tensors:
        out[f"{name}.bias"] = tensors["bias"].to(dtype)
    return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 64 == 0 else t.clone()
