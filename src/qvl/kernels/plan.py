"""The kernel plan: which kernel runs each kind of layer, decided once at load from the library
(the CPU's tier, or QVL_ISA) and the options (compute dtype, weight format, --int8-activations),
and stored on the modules that run it. `qvl info` prints it; the tests assert it per tier.

Why each choice: docs/decisions/int8-activations.md (which layers, which codes, per CPU),
docs/decisions/prefill-products.md (many-row int8 kernels per tier), docs/decisions/amx.md,
docs/decisions/attention.md, docs/decisions/decode-step.md, docs/decisions/delta-rule-chunk.md, docs/decisions/int8-weights.md and
docs/decisions/compute-dtype.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qvl.kernels.build import AMX_INT8, AVX2, BF16, VNNI
from qvl.kernels.library import Library, library
from qvl.kernels.linear import (ACTIVATION_GROUP, VISION_ACTIVATION_GROUP, amx_bf16_takes, amx_tiles_take,
                                int4_kernel_takes, int8_kernel_takes)

GEMV_MAX_ROWS = 16  # up to this many activation rows the GEMV kernels beat dequantise + GEMM
AMX_GEMV_MAX_ROWS = 64  # int8 on AMX tiles: the GEMV up to this many rows
INT8_ACTIVATIONS = ("auto", "off", "vision", "all")
# an int8 weight of at most this many output columns, and at most 1/16 of its inputs, runs many
# rows by dequantise + GEMM: its product is then cheaper than the integer kernels' pass that
# codes the activations (Gated DeltaNet's in_proj_b and in_proj_a, one column per value head:
# 16 of 2,048 inputs over 4,000 rows take 1.6 ms in bfloat16 against 4 ms through oneDNN's int8
# GEMM)
NARROW_COLUMNS = 64
PACKED = ("onednn_int8", "amx_int8")  # int8 x int8 kernels that read a packed copy of the weight
_FLOAT = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Kernel:
    """One choice: the kernel's name, its activations' integer codes in bits (sign included; 0:
    float products), the dtype it computes in and, for the byte kernels, the input columns that
    share one code step (0: a step per row, or no codes)."""

    name: str
    code_bits: int
    dtype: torch.dtype
    group: int = 0


@dataclass(frozen=True)
class LinearPlan:
    """What runs one weight matrix's products: `decode` for up to `decode_rows` activation rows
    (`prompt_rows` for a prompt's tokens: see products.prompt_products), `prefill` for more."""

    decode: Kernel
    prefill: Kernel
    decode_rows: int
    prompt_rows: int


@dataclass(frozen=True)
class Plan:
    """The kernels of every kind of layer for one library, compute dtype and set of options."""

    library: Library
    dtype: torch.dtype  # compute dtype
    weights: str = "bf16"  # the text decoder's: bf16 | fp32 | int8 | int4
    vision_int8: bool = False  # the vision tower's linears are int8
    activations: str = "off"  # which int8 layers run many rows int8 x int8: off | vision | all

    @classmethod
    def choose(cls, lib: Library, dtype: torch.dtype, weights: str, int8_activations: str = "auto",
               vision_int8: bool | None = None, stored_vision: bool | None = None) -> Plan:
        """The plan for these options. int8/int4 weights: --int8-activations auto runs int8 x int8
        where this CPU's integer products beat its float ones (default_int8_activations); the
        vision tower is int8 there and wherever compute is float32, unless the options (or a
        pre-quantised checkpoint: stored_vision) say otherwise. ValueError for contradictions."""
        base = cls(lib, dtype, weights)
        if weights not in ("int8", "int4"):
            return base
        if int8_activations not in INT8_ACTIVATIONS:
            raise ValueError(f"int8 activations must be one of {', '.join(INT8_ACTIVATIONS)}, "
                             f"not '{int8_activations}'")
        acts = int8_activations
        if acts == "auto":
            acts = base.default_int8_activations
        elif acts != "off" and not base.group_codes and lib.int8_levels == 0:
            raise ValueError(f"--int8-activations {acts}: torch has no exact int8 GEMM on this CPU")
        vision = stored_vision if stored_vision is not None else vision_int8
        if vision is None:
            vision = acts != "off" or dtype == torch.float32
        if not vision and acts == "vision":
            if int8_activations == "vision":
                raise ValueError("int8 activations in the vision tower need its int8 weights: drop --no-vision-int8"
                                 + (" (this pre-quantised checkpoint has a bf16 vision tower)"
                                    if stored_vision is not None else ""))
            acts = "off"
        return cls(lib, dtype, weights, vision, acts)

    # -- what the library offers for this dtype ------------------------------------------------
    @property
    def native(self) -> bool:
        return self.library.lib is not None

    @property
    def bf16_products(self) -> bool:
        """bf16 compute on a build with AVX512-BF16 dot products."""
        return self.native and self.dtype == torch.bfloat16 and self.library.has(BF16)

    @property
    def amx_bf16(self) -> bool:
        """bf16 compute where the process has AMX tiles: they take prefill's int8 products."""
        return self.dtype == torch.bfloat16 and self.library.has(AMX_INT8)

    @property
    def group_codes(self) -> bool:
        """The byte kernel (activation codes per ACTIVATION_GROUP columns) runs here."""
        return self.library.q8_levels > 0 and self.dtype in _FLOAT and not self.amx_bf16

    @property
    def pair_products(self) -> bool:
        """The 16-bit pair kernel (16-bit codes per row) runs here: x86, except bf16 on AMX."""
        return self.native and self.library.has(AVX2) and self.dtype in _FLOAT and not self.amx_bf16

    @property
    def default_int8_activations(self) -> str:
        """--int8-activations auto: "all" (the vision tower and prefill) where the byte kernel runs
        in 8-bit codes, and for int4 weights wherever it runs (their products take 8-bit codes on
        every build: nibbles never saturate plain AVX2's byte pairs); "vision" where it runs in
        7-bit ones (plain AVX2) or where oneDNN's or AMX's int8 GEMM beats the float one (x86 with
        the native kernels); else "off"."""
        if self.group_codes:
            return "all" if self.library.q8_code_bits == 8 or self.weights == "int4" else "vision"
        return "vision" if self.native and self.library.has(AVX2) and self.library.int8_levels > 0 else "off"

    @property
    def int8_code_bits(self) -> int:
        """The activation codes of int8 x int8 layers: the byte kernel's, else oneDNN's per row."""
        return self.library.q8_code_bits if self.group_codes else 8 if self.library.int8_levels == 255 else 7

    # -- element-wise ops, attention and the decode step (the same for every option) ----------
    @functools.cached_property
    def rms_norm(self) -> str:
        return "qvl_rmsnorm" if self.native and self.dtype == torch.bfloat16 else "torch"  # float32: torch's is as fast

    @functools.cached_property
    def silu_mul(self) -> str:
        """SiLU * up in one native pass in bf16 (rounded as torch rounds); torch's in float32."""
        return "qvl_silu_mul" if self.bf16_products else "torch"

    @functools.cached_property
    def text_rope(self) -> str:
        """Prefill's rotary embedding of one row in one native pass in bf16; torch's in float32."""
        return "qvl_text_rope" if self.bf16_products else "torch"

    @functools.cached_property
    def vision_rope(self) -> str:
        return "qvl_vision_rope" if self.bf16_products else "torch"

    @functools.cached_property
    def prefill_attention(self) -> str:
        """Causal prefill attention over the paged cache: qvl's flash kernel (AMX-BF16 tiles where
        the process has them, else AVX512-BF16 dot products), else torch's SDPA."""
        return "qvl_attention" if self.bf16_products else "sdpa"

    @functools.cached_property
    def decode_attention(self) -> str:
        return "qvl_decode_attention" if self.native and self.dtype in _FLOAT else "sdpa"

    @functools.cached_property
    def image_attention(self) -> str:
        """The vision tower's attention in float: the flash kernel (not the AVX512-BF16 one on an
        AMX CPU run without its tiles), else torch's SDPA."""
        return "qvl_attention" if self.bf16_products and (not self.library.tier.amx or self.library.has(AMX_INT8)) \
            else "sdpa"

    @functools.cached_property
    def vision_attention(self) -> str:
        """The vision tower's attention: in integer codes where its linears run int8 x int8 (16-bit
        pairs in float32 on x86; 8-bit byte products in bf16 with AVX-512 VNNI and no AMX), else
        image_attention."""
        if self.vision_int8 and self.activations != "off":
            if self.native and self.library.has(AVX2) and self.dtype == torch.float32:
                return "qvl_attention_i16"
            if self.bf16_products and self.library.has(VNNI) and not self.library.tier.amx:
                return "qvl_attention_q8"
        return self.image_attention

    @functools.cached_property
    def decode_step(self) -> str:
        """All decoder layers of a decode step in one native call, else the per-layer modules."""
        return "qvl_decode_layers" if self.native and self.dtype in _FLOAT else "per-layer"

    @functools.cached_property
    def delta_rule(self) -> str:
        """Gated DeltaNet's chunked delta rule (prefill) and its short convolution, in float32 on
        every build; else torch's ops (docs/decisions/delta-rule-chunk.md)."""
        return "qvl_gated_delta_rule" if self.native and self.dtype in _FLOAT else "torch"

    @functools.cached_property
    def delta_step(self) -> str:
        """The delta rule's decode step (each state read once) and the convolution's, natively on every build."""
        return "qvl_gated_delta_step" if self.native and self.dtype in _FLOAT else "torch"

    # -- linear layers -------------------------------------------------------------------------
    def int8_mode(self, kind: str) -> str:
        """How a layer of `kind` (text, vision, lm_head) runs many rows: "codes" (the byte kernel),
        "packed" (int8 x int8 on a packed weight) or "off". The head never: prefill computes only
        its last row's logits."""
        on = (kind == "vision" and self.activations != "off") or (kind == "text" and self.activations == "all")
        return "off" if not on else "codes" if self.group_codes else "packed"

    def linear(self, kind: str, weights: str, n: int, k: int, group_size: int = 0, packable: bool = True) -> LinearPlan:
        """The plan of a weight [n, k] stored as `weights` (int8, int4 or a float dtype's name) in
        a layer of `kind`; `packable`: it can take a packed int8 x int8 weight (not the experts)."""
        if weights == "int4":
            many = self._int4_many(kind, n, k, group_size)
            return LinearPlan(Kernel("gemv", 8, self.dtype) if self._gemv else many, many, GEMV_MAX_ROWS, GEMV_MAX_ROWS)
        if weights != "int8":
            gemv = self.native and weights == "bf16"
            return LinearPlan(Kernel("gemv" if gemv else "torch", 0, self.dtype), Kernel("torch", 0, self.dtype),
                              GEMV_MAX_ROWS, GEMV_MAX_ROWS)
        rows = AMX_GEMV_MAX_ROWS if self.library.has(AMX_INT8) else GEMV_MAX_ROWS
        decode = Kernel("gemv", 16, self.dtype) if self._gemv else Kernel("torch_int8", 0, self.dtype)
        mode = self.int8_mode(kind)
        if kind == "text" and n <= NARROW_COLUMNS and 16 * n <= k:
            return LinearPlan(decode, Kernel("dequantize", 0, self.dtype), rows, 0)
        if mode == "packed" and packable:
            amx = self.library.has(AMX_INT8) and amx_tiles_take(n, k)
            many = Kernel("amx_int8" if amx else "onednn_int8", self.int8_code_bits, self.dtype)
            return LinearPlan(many if kind == "vision" else decode, many, rows, 0)  # the tower keeps no plain weight
        return LinearPlan(decode, self._int8_many(kind, n, k, mode == "codes"), rows, 0)

    @property
    def _gemv(self) -> bool:
        return self.native and self.dtype in _FLOAT

    def _int8_many(self, kind: str, n: int, k: int, codes: bool) -> Kernel:
        """Many rows of an int8 weight [n, k] in a layer of `kind`: 16-bit codes per row on AMX
        int8 tiles (bf16 on AMX; bf16 tiles for the shapes those do not take), 8-bit codes per
        group (`codes`) in the byte kernel (per ACTIVATION_GROUP columns, the vision tower's 8-bit
        codes per VISION_ACTIVATION_GROUP), 16-bit codes per row in the pair kernel (x86), else
        dequantise + GEMM."""
        if self.amx_bf16:
            if int8_kernel_takes("amx_i16_linear", n, k):
                return Kernel("amx_i16_linear", 16, self.dtype)
            return Kernel("amx_bf16_linear" if amx_bf16_takes(n, k) else "dequantize", 0, self.dtype)
        if codes and self.group_codes and int8_kernel_takes("q8_linear", n, k):
            wide = kind == "vision" and self.library.q8_code_bits == 8  # plain AVX2's 7-bit codes keep 64
            group = VISION_ACTIVATION_GROUP if wide else ACTIVATION_GROUP
            return Kernel("q8_linear", self.library.q8_code_bits, self.dtype, group)
        if self.pair_products and int8_kernel_takes("i16_linear", n, k):
            return Kernel("i16_linear", 16, self.dtype)
        return Kernel("dequantize", 0, self.dtype)

    def _int4_many(self, kind: str, n: int, k: int, group_size: int) -> Kernel:
        """Many rows of an int4 weight in a layer of `kind`: bf16 on AMX tiles (converted panel by
        panel), 8-bit codes per group in the byte kernel where int8 weights take it (the nibbles
        unpacked in its panels), else dequantise + GEMM."""
        if self.amx_bf16:
            amx = amx_bf16_takes(n, k, group_size, int4=True)
            return Kernel("amx_bf16_linear" if amx else "dequantize", 0, self.dtype)
        if self.int8_mode(kind) == "codes" and int4_kernel_takes(n, k, group_size):
            return Kernel("q4_linear", 8, self.dtype, ACTIVATION_GROUP)
        return Kernel("dequantize", 0, self.dtype)

    def entries(self) -> dict[str, Kernel]:
        """Kind of layer -> its kernel (for `qvl info` and the tests), the linears' for weights of
        a shape every kernel takes."""
        def op(name: str, bits: int = 0) -> Kernel:
            return Kernel(name, bits, self.dtype)

        text = self.linear("text", self.weights, 2048, 2048, 128)
        vision = self.linear("vision", "int8", 2048, 2048).prefill if self.vision_int8 else op("torch")
        codes = {"qvl_attention_i16": 16, "qvl_attention_q8": 8}.get(self.vision_attention, 0)
        return {"text linears, decode": text.decode, "text linears, prefill": text.prefill,
                "lm_head": self.linear("lm_head", self.weights, 2048, 2048, 128).decode,
                "vision linears": vision, "text attention, prefill": op(self.prefill_attention),
                "text attention, decode": op(self.decode_attention),
                "vision attention": op(self.vision_attention, codes), "rms_norm": op(self.rms_norm),
                "rope, text prefill": op(self.text_rope), "rope, vision": op(self.vision_rope),
                "silu_mul": op(self.silu_mul), "decode step": op(self.decode_step),
                "delta rule, prefill": op(self.delta_rule), "delta rule, decode": op(self.delta_step),
                "short conv, prefill": op("qvl_causal_conv" if self.delta_rule != "torch" else "torch"),
                "short conv, decode": op("qvl_causal_conv_step" if self.delta_step != "torch" else "torch")}

    def apply(self, model: torch.nn.Module) -> None:
        """Give every linear layer, mixture's experts and vision attention of `model` its plan,
        and pack the weights the int8 x int8 kernels read."""
        from qvl.model.vision import VisionAttention  # the model and quantize import the kernels package
        from qvl.quantize import PLANNED_LAYERS

        for name, module in model.named_modules():
            if isinstance(module, PLANNED_LAYERS):
                module.use_plan(self, layer_kind(name))
            elif isinstance(module, VisionAttention):
                module.plan = self.vision_attention


def layer_kind(name: str) -> str:
    """The plan's kind of a module: "vision" (the tower), "text" (decoder layers), "lm_head", "other"."""
    if name.startswith("visual."):
        return "vision"
    if name.startswith("language_model.layers."):
        return "text"
    return "lm_head" if name == "lm_head" else "other"


_defaults: dict[torch.dtype, Plan] = {}


def default_plan(dtype: torch.dtype) -> Plan:
    """The plan of this process's library for `dtype` with no options (a model loaded outside
    Engine.load; element-wise ops and attention read theirs from it)."""
    plan = _defaults.get(dtype)
    if plan is None or plan.library is not library():
        plan = _defaults[dtype] = Plan(library(), dtype)
    return plan
