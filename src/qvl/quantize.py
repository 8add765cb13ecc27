"""Weight-only int8 / int4 quantisation as a module swap.

int8: symmetric, one scale per output channel. int4: asymmetric min/max per group of
`group_size` inputs, two codes per byte. The quantised modules (and Bf16Linear) run the kernels
their plan names (qvl.kernels.plan, given at load) through qvl.kernels.products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qvl.kernels import products
from qvl.kernels.plan import PACKED, LinearPlan, Plan
from qvl.kernels.products import dequantize_int4, dequantize_int8

WEIGHT_FORMATS = ("bf16", "fp32", "int8", "int4")
SMOOTHING = ("none", "data-free", "calibrated")

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
    in the low nibble (products.unpack_nibbles reads it back)."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


# -- modules ------------------------------------------------------------------------------

class Bf16Linear(nn.Linear):
    """nn.Linear (same parameters) of the text decoder, whose decoding products run the native
    bf16 GEMV where its plan says so: oneDNN's reads the weights at about half the memory bandwidth."""

    plan: LinearPlan | None = None  # what runs its products (qvl.kernels.plan), given at load

    def use_plan(self, plan: Plan, kind: str) -> None:
        self.plan = plan.linear(kind, "bf16" if self.weight.dtype == torch.bfloat16 else "fp32", self.out_features,
                                self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return products.float_linear(self, x)


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
    """int8 weights [O, I], a scale per output row. Its plan (given at load) names the kernels of
    few-row (decoding) and many-row (prefill, vision) products: the GEMV, the integer kernels
    (16-bit codes per row, 8-bit codes per group), int8 x int8 on a packed copy of the weight
    (oneDNN's int8 GEMM or AMX tiles), or dequantise + GEMM."""

    fuses_gelu_tanh = True  # forward(x, gelu_tanh=True): see kernels.ops.linear_gelu_tanh
    fuses_residual = True  # forward(x, residual=r) = r + forward(x): see kernels.ops.residual_linear
    fuses_layer_norm = True  # forward(x, norm=n) = forward(n(x)) for an nn.LayerNorm n: see kernels.ops.norm_linear
    plan: LinearPlan | None = None  # what runs its products (qvl.kernels.plan), given at load
    packed: torch.Tensor | None = None  # the weight for int8 x int8 products: AMX tiles or oneDNN's copy
    colsums: torch.Tensor | None = None  # [O] float32: the weight codes' sums over I

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    def use_plan(self, plan: Plan, kind: str) -> None:
        """Run the products `plan` gives a layer of `kind`; a plan of int8 x int8 products packs
        the weight (and drops the plain one where the plan decodes from the packed copy too)."""
        new = plan.linear(kind, "int8", self.out_features, self.in_features)
        if self.weight is None and new.decode.name not in PACKED:
            raise ValueError("this layer keeps only its packed weight: it takes int8 x int8 plans only")
        self.plan = new
        if new.prefill.name not in PACKED:
            self.packed = self.colsums = None
        elif self.weight is not None:
            products.pack(self, keep_weight=new.decode.name not in PACKED)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or some of its rows) in the compute dtype."""
        return dequantize_int8(self.weight, self.scales, rows)

    def forward(self, x: torch.Tensor, gelu_tanh: bool = False, residual: torch.Tensor | None = None,
                norm: nn.LayerNorm | None = None) -> torch.Tensor:
        # x: [..., I] -> [..., O]: norm(x) first when given, then the product, tanh-GELU when
        # gelu_tanh, residual + that when given ([..., O])
        return products.int8_linear(self, x, gelu_tanh, residual, norm)


class Int8Experts(nn.Module):
    """A mixture's experts with int8 weights, one scale per output row of each expert, stored
    output-major as linears are: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I], scales [E, 2I] and [E, H]. A call reads only its expert's matrices: memory-mapped
    from the quantised-weights cache, the experts never chosen are never read."""

    plan: tuple[LinearPlan, LinearPlan] | None = None  # gate_up's and down's (qvl.kernels.plan), given at load

    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("gate_up_proj", torch.empty(experts, 2 * inter, hidden, dtype=torch.int8))
        self.register_buffer("gate_up_proj_scales", torch.empty(experts, 2 * inter, dtype=dtype))
        self.register_buffer("down_proj", torch.empty(experts, hidden, inter, dtype=torch.int8))
        self.register_buffer("down_proj_scales", torch.empty(experts, hidden, dtype=dtype))

    def use_plan(self, plan: Plan, kind: str) -> None:
        self.plan = tuple(plan.linear(kind, "int8", w.shape[1], w.shape[2], packable=False)
                          for w in (self.gate_up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, H] tokens routed to `expert` -> [n, H]
        gate_up, down = self.plan or (None, None)
        gate, up = products.int8_product(x, self.gate_up_proj[expert], self.gate_up_proj_scales[expert], None,
                                         products.kernel_for(gate_up, x)).chunk(2, dim=-1)
        h = F.silu(gate) * up
        return products.int8_product(h, self.down_proj[expert], self.down_proj_scales[expert], None,
                                     products.kernel_for(down, h))

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


class Int4Experts(nn.Module):
    """A mixture's experts with int4 weights (as Int4Linear: nibbles, a scale and a zero per
    group of `group_size` inputs), output-major: gate_up_proj [E, 2I, H/2], down_proj
    [E, H, I/2], with scales and zeros per group. A call reads only its expert's matrices."""

    plan: tuple[LinearPlan, LinearPlan] | None = None  # gate_up's and down's (qvl.kernels.plan), given at load

    def __init__(self, experts: int, hidden: int, inter: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.group_size = group_size
        for leaf, out, inp in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            self.register_buffer(leaf, torch.empty(experts, out, inp // 2, dtype=torch.uint8))
            self.register_buffer(f"{leaf}_scales", torch.empty(experts, out, inp // group_size, dtype=dtype))
            self.register_buffer(f"{leaf}_zeros", torch.empty(experts, out, inp // group_size, dtype=dtype))

    def use_plan(self, plan: Plan, kind: str) -> None:
        self.plan = tuple(plan.linear(kind, "int4", w.shape[1], 2 * w.shape[2], self.group_size)
                          for w in (self.gate_up_proj, self.down_proj))

    def _product(self, x: torch.Tensor, leaf: str, expert: int, plan: LinearPlan | None) -> torch.Tensor:
        return products.int4_product(x, getattr(self, leaf)[expert], getattr(self, f"{leaf}_scales")[expert],
                                     getattr(self, f"{leaf}_zeros")[expert], self.group_size,
                                     products.kernel_for(plan, x))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, H] tokens routed to `expert` -> [n, H]
        gate_up, down = self.plan or (None, None)
        gate, up = self._product(x, "gate_up_proj", expert, gate_up).chunk(2, dim=-1)
        return self._product(F.silu(gate) * up, "down_proj", expert, down)

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
    """int4 weights: nibbles [O, I/2], a scale and a zero per group of `group_size` inputs."""

    plan: LinearPlan | None = None  # what runs its products (qvl.kernels.plan), given at load

    def __init__(self, in_features: int, out_features: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=dtype))

    def use_plan(self, plan: Plan, kind: str) -> None:
        self.plan = plan.linear(kind, "int4", self.out_features, self.in_features, self.group_size)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_int4(self.weight, self.scales, self.zeros, self.group_size, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return products.int4_product(x, self.weight, self.scales, self.zeros, self.group_size,
                                     products.kernel_for(self.plan, x))


PLANNED_LAYERS = (Bf16Linear, Int8Linear, Int8Experts, Int4Linear, Int4Experts)  # they take a plan (use_plan)


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
    """The text decoder's float linears (those not quantised, and a mixture's router) become
    Bf16Linear, whose plan decodes them with the native GEMV, as the one-call decode step does."""
    for name, module in model.named_modules():
        if type(module) is nn.Linear and (_is_text(name) or name.endswith(".mlp.gate")):
            module.__class__ = Bf16Linear


def swap_modules(model: nn.Module, spec: QuantSpec, dtype: torch.dtype) -> list[str]:
    """Replace the quantised linears by empty int8/int4 modules (int4 only where the group size
    divides their inputs, else int8), and a mixture's experts by experts of the same format
    (int4 only where the group size divides both of their input sizes), before loading. Returns the replaced modules' names."""
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
        if spec.weights == "int8" or vision or old.in_features % spec.group_size:  # int4 needs whole groups
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
