"""Weight-only int8 / int4 quantisation as a module swap.

int8: symmetric, one scale per output channel. int4: asymmetric min/max per group of
`group_size` inputs. Decoding (a few rows) runs torch's CPU weight-only kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which read 1 or 0.5 bytes per
weight; prefill and vision (many rows) dequantise one matrix at a time and run the
dtype's GEMM, where those kernels are slower than oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FORMATS = ("bf16", "fp32", "int8", "int4")
KERNEL_MAX_ROWS = 16  # up to this many activation rows the weight-only kernels win
INT4_BLOCK = 64  # torch's CPU int4 layout packs rows in blocks of 64


@dataclass(frozen=True)
class QuantSpec:
    weights: str  # "int8" | "int4"
    group_size: int = 128
    vision: bool = False  # also int8 for the vision tower

    def __post_init__(self):
        if self.weights not in ("int8", "int4"):
            raise ValueError(f"quantised weights must be int8 or int4, not '{self.weights}'")
        if self.group_size not in (32, 64, 128, 256):
            raise ValueError("group size must be 32, 64, 128 or 256")

    def metadata(self) -> dict[str, str]:
        return {"qvl_weights": self.weights, "qvl_group_size": str(self.group_size),
                "qvl_vision_int8": str(self.vision).lower()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> QuantSpec | None:
        if meta.get("qvl_weights") not in ("int8", "int4"):
            return None
        return cls(meta["qvl_weights"], int(meta["qvl_group_size"]), meta.get("qvl_vision_int8") == "true")


# -- the arithmetic -----------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [O, I] -> int8 [O, I], scales [O] float32; w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [O, I] -> codes uint8 [O, I] in 0..15, scales and zeros [O, I/g] float32;
    w ~= (q - 8) * scale + zero (the convention of torch's int4 kernels)."""
    o, i = w.shape
    g = w.float().view(o, i // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).view(o, i)
    return q, scale, lo + 8 * scale


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Portable int4 storage: [O, I] codes -> [O, I/2] uint8, even column in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 0xF, p >> 4], -1).flatten(1)


def to_kernel_layout(q: torch.Tensor) -> torch.Tensor:
    """[O, I] codes -> torch's CPU int4 layout [O, I/2] uint8 (what
    `torch._convert_weight_to_int4pack_for_cpu` computes, without its int32 copy)."""
    o, i = q.shape
    blocks = q.to(torch.uint8).view(o // INT4_BLOCK, 2, INT4_BLOCK // 2, i)
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [O/64, 32, I]: rows d and d + 32 share a byte
    return packed.transpose(1, 2).contiguous().view(o, i // 2)


def from_kernel_layout(p: torch.Tensor) -> torch.Tensor:
    """Inverse of to_kernel_layout: in each block of 64 rows, byte [k, d] holds row d in
    the low nibble and row d + 32 in the high nibble. -> [O, I] uint8 codes."""
    o, half = p.shape
    blocks = p.view(o // INT4_BLOCK, 2 * half, INT4_BLOCK // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], 2).transpose(1, 2).reshape(o, 2 * half)


# -- modules ------------------------------------------------------------------------------

def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or some of its rows) in the compute dtype."""
        w, s = (self.weight, self.scales) if rows is None else (self.weight[rows], self.scales[rows])
        return w.to(s.dtype) * s[..., None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., I] -> [..., O]
        if _rows(x) > KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantized(), self.bias)
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(in_features // group_size, out_features, 2, dtype=dtype))

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        sz = self.scales_and_zeros
        if rows is None:
            q = from_kernel_layout(self.weight)
        else:  # only the 64-row blocks holding the wanted rows
            blocks = rows // INT4_BLOCK
            packed = self.weight.view(-1, INT4_BLOCK, self.in_features // 2)[blocks]
            q = from_kernel_layout(packed.flatten(0, 1)).view(len(rows), INT4_BLOCK, -1)
            q = q[torch.arange(len(rows)), rows % INT4_BLOCK]
            sz = sz[:, rows]
        rows_out, g = q.shape[0], self.group_size
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [O, I/g, 1]: no full-size copies
        w = (q.view(rows_out, -1, g).to(sz.dtype) - 8).mul_(scale).add_(zero)
        return w.view(rows_out, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _rows(x) > KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantized())
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.weight, self.group_size,
                                              self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)


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
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        text = name.startswith("language_model.") or name == "lm_head"
        if text or (spec.vision and name.startswith("visual.")):
            names.append(name)
    return names


def swap_modules(model: nn.Module, spec: QuantSpec, dtype: torch.dtype) -> list[str]:
    """Replace the quantised linears by empty int8/int4 modules (before loading)."""
    names = quantized_linear_names(model, spec)
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
    return names


def quantized_state(module: nn.Module, name: str, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A float weight [O, I] -> the module's buffers, under `name.weight` etc."""
    if isinstance(module, Int4Linear):
        q, scale, zero = quantize_int4(w, module.group_size)
        return {f"{name}.weight": to_kernel_layout(q),
                f"{name}.scales_and_zeros": torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous()}
    q, scale = quantize_int8(w)
    return {f"{name}.weight": q, f"{name}.scales": scale.to(dtype)}


def portable_state(module: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """A quantised module's tensors for a file: independent of torch's kernel layout.
    int8: weight (int8) + weight_scale; int4: weight (nibbles) + weight_scale + weight_zero."""
    if isinstance(module, Int4Linear):
        sz = module.scales_and_zeros
        return {f"{name}.weight": pack_nibbles(from_kernel_layout(module.weight)),
                f"{name}.weight_scale": sz[..., 0].t().contiguous(), f"{name}.weight_zero": sz[..., 1].t().contiguous()}
    out = {f"{name}.weight": module.weight, f"{name}.weight_scale": module.scales}
    if module.bias is not None:
        out[f"{name}.bias"] = module.bias
    return out


def state_from_portable(module: nn.Module, name: str, tensors: dict[str, torch.Tensor],
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Inverse of portable_state (for loading a pre-quantised checkpoint). The int8 kernel
    needs 64-byte aligned weights: files qvl writes are (save_aligned) and stay memory-
    mapped; tensors of other files are copied into aligned memory."""
    if isinstance(module, Int4Linear):
        q = unpack_nibbles(tensors["weight"])
        sz = torch.stack([tensors["weight_scale"].t(), tensors["weight_zero"].t()], -1)  # a new tensor
        return {f"{name}.weight": to_kernel_layout(q), f"{name}.scales_and_zeros": sz.to(dtype).contiguous()}
    out = {f"{name}.weight": _aligned(tensors["weight"]), f"{name}.scales": _aligned(tensors["weight_scale"].to(dtype))}
    if "bias" in tensors:
        out[f"{name}.bias"] = tensors["bias"].to(dtype)
    return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 64 == 0 else t.clone()
