"""Which kernel runs each product: decided once, at load, from the CPU (or QVL_ISA).

Model and quantisation code ask `kernels()` (for example `kernels().flash_attention(dtype)`)
and never probe the CPU or the build themselves. `qvl info` prints `kernels().describe()`.

QVL_ISA=avx512|avx512-nobf16|avx2-vnni|avx2|neon|neon-nodotprod|portable forces a tier this
CPU can run (tests and benchmarks use it, with torch's ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA
and MKL_ENABLE_INSTRUCTIONS, to emulate an older CPU); QVL_NATIVE=0 turns the native kernels off."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass

import torch

from qvl import native, paths


@dataclass(frozen=True)
class Kernels:
    """The chosen tier, its library (None: torch's kernels everywhere) and what it runs."""

    tier: native.Tier
    lib: ctypes.CDLL | None
    reason: str = ""  # why lib is None

    @property
    def features(self) -> int:
        return self.lib.features if self.lib is not None else 0

    def has(self, bit: int) -> bool:
        return bool(self.features & bit)

    # -- what runs each product -------------------------------------------------------------
    def gemv(self, dtype: torch.dtype) -> bool:
        """Products of up to native.GEMV_MAX_ROWS rows with bf16/int8/int4 weights (decoding)."""
        return self.lib is not None and dtype in (torch.bfloat16, torch.float32)

    @property
    def int8_gemv_rows(self) -> int:
        """Up to how many rows int8 products take the GEMV kernel rather than dequantising for a
        float GEMM: 64 on AMX tiles (1.05-3.6x dequantise + oneDNN's bf16 GEMM from 16 to 64
        rows, 0.7-1.25x at 96-128: docs/benchmarks.md section 29), else native.GEMV_MAX_ROWS."""
        return 64 if self.has(native.AMX_INT8) else native.GEMV_MAX_ROWS

    def dequantize(self) -> bool:
        return self.lib is not None

    def int8_gemm(self) -> bool:
        """Quantise/rescale passes around torch._int_mm (int8 activations)."""
        return self.lib is not None

    def int8_activations(self) -> bool:
        """Many-row int8 x int8 products (oneDNN's int8 GEMM, prepacked weights) beat the tier's
        float GEMM, so the vision tower runs them by default: on x86 (2.3-3.4x MKL's float32 on
        AVX-512 VNNI, 2.2-3.1x with AVX-VNNI, 1.5-1.7x on plain AVX2 with 7-bit activations,
        ~1.6x bf16 on Zen 5, 1.7x bf16 on AMX, whose int8 tiles oneDNN uses: docs/benchmarks.md
        sections 21, 24 and 25). NEON is unmeasured."""
        return self.int8_gemm() and self.has(native.AVX2) and self.int8_levels > 0

    def int8_tiles(self, out_features: int, in_features: int) -> bool:
        """Many-row int8 x int8 products run qvl's AMX kernel (int8 tiles, each block of sums
        rescaled while in cache: docs/benchmarks.md section 36) rather than oneDNN's GEMM and a
        separate rescale pass; it takes weights of a multiple of 16 rows and up to 65,536
        columns (its int32 sums)."""
        return self.has(native.AMX_INT8) and out_features % 16 == 0 and in_features <= 65536

    def i16_products(self, dtype: torch.dtype) -> bool:
        """Many-row products with int8 weights (prefill) run qvl's 16-bit pair kernel (each row
        in 16-bit codes, exact integer sums, no dequantised weight: i16_gemm.c) on x86, except
        bf16 ones on AMX (whose int8 tiles take them). Per product, against dequantising for the
        tier's GEMM: 4.1-6.3x MKL's float32 with AVX-512 VNNI, 2.2-3.3x with AVX-VNNI, 1.7-2.9x
        with plain AVX2, 0.97-1.4x oneDNN's bf16 on Zen 5 (docs/benchmarks.md section 37)."""
        return (self.lib is not None and self.has(native.AVX2) and dtype in (torch.float32, torch.bfloat16)
                and not (dtype == torch.bfloat16 and self.has(native.AMX_INT8)))

    @property
    def q8_levels(self) -> int:
        """The byte-product kernel's top activation code: 127 (8-bit codes) with VNNI, AVX-VNNI or
        ARM's dot products; 63 (7-bit) on plain AVX2, whose vpmaddubsw sums pairs of products in
        16 bits; 0 where the build has no byte kernel."""
        return self.lib.q8_levels if self.lib is not None else 0

    @property
    def q8_code_bits(self) -> int:
        """The byte kernel's activation codes in bits, sign included: 8, 7 on plain AVX2, 0 (no kernel)."""
        return (self.q8_levels + 1).bit_length() if self.q8_levels else 0

    def group_codes(self, dtype: torch.dtype) -> bool:
        """Prefill's int8 products can take activation codes per native.ACTIVATION_GROUP columns
        (qvl's byte-product kernel, i16_gemm.c's qvl_q8_linear: vpdpbusd with AVX-512 VNNI or
        AVX-VNNI, 1.7-1.9x the 16-bit pair kernel per product: docs/benchmarks.md section 40; sdot
        on ARM with dot products, four times the multiply-adds of a float32 FMA per instruction,
        unmeasured here: section 49; vpmaddubsw in 7-bit codes on plain AVX2, 1.15-1.37x the pair
        kernel on Intel's ports: section 53), except bf16 ones on AMX (whose int8 tiles take them)."""
        return (self.q8_levels > 0 and dtype in (torch.float32, torch.bfloat16)
                and not (dtype == torch.bfloat16 and self.has(native.AMX_INT8)))

    def default_int8_activations(self, dtype: torch.dtype) -> str:
        """What runs int8 x int8 by default (--int8-activations auto): "all" (the vision tower and
        prefill) where the byte-product kernel runs in 8-bit codes; "vision" where it runs in 7-bit
        ones (plain AVX2: prefill keeps 16-bit codes) or where oneDNN's or AMX's int8 GEMM beats
        the float one; else "off"."""
        if self.group_codes(dtype):  # prefill's codes 8-bit: 7-bit ones move the logits too far (section 53)
            return "all" if self.q8_code_bits == 8 else "vision"
        return "vision" if self.int8_activations() else "off"

    @functools.cached_property
    def int8_levels(self) -> int:
        """The activation codes 0..levels whose products oneDNN's int8 GEMM sums exactly against
        any int8 weights: 255 where it multiplies with VNNI or AMX; 127 where it multiplies with
        vpmaddubsw (plain AVX2, AVX-512 without VNNI), whose 16-bit pair sums saturate on 8-bit
        codes (2 * 255 * 127 > 2^15) but not on 7-bit ones; 0 when neither holds or the op is
        missing. Probed once, on this process's oneDNN, with the worst-case rows and columns."""
        return next((levels for levels in (255, 127) if _int8_gemm_is_exact(levels)), 0)

    def decode_attention(self, dtype: torch.dtype) -> bool:
        return self.lib is not None and dtype in (torch.bfloat16, torch.float32)

    def flash_attention(self, dtype: torch.dtype) -> bool:
        """Causal prefill attention: qvl's flash kernel, reading through the block table, on
        AMX-BF16 tiles where the process has them (0.35-0.47x torch's SDPA: docs/benchmarks.md
        section 52), else on AVX512-BF16 dot products; a query row's result does not depend on
        the slice it comes in. Elsewhere torch's SDPA, its own flash kernel vectorised for the CPU."""
        return self._bf16_products(dtype)

    def vision_attention(self, dtype: torch.dtype) -> bool:
        """The vision tower's attention (no mask): qvl's flash kernel on AMX-BF16 tiles where
        the process has them (even head sizes up to 128), else on AVX512-BF16 dot products
        except on an AMX CPU; elsewhere torch's SDPA."""
        return self._bf16_products(dtype) and (not self.tier.amx or self.has(native.AMX_INT8))

    def byte_vision_attention(self, dtype: torch.dtype) -> bool:
        """The vision tower's attention in 8-bit integer codes (qvl_attention_q8: scores and value
        products on VNNI's byte products, half the instructions of bf16 pairs) where its linears
        run int8 x int8 in bf16 compute (the caller asks only then): AVX-512 with VNNI and BF16,
        no AMX (whose tiles take the whole attention). docs/benchmarks.md section 51."""
        return self._bf16_products(dtype) and self.has(native.VNNI) and not self.tier.amx

    def integer_vision_attention(self, dtype: torch.dtype) -> bool:
        """The vision tower's attention in 16-bit integer codes (qvl_attention_i16: vpmaddwd pairs,
        twice the float32 FMA's multiply-adds; AVX-512 builds: zmm, vpdpwssd with AVX512-VNNI)
        where its linears run int8 x int8 in float32 compute (the caller asks only then): x86
        with AVX2. 0.65x torch's float32 SDPA at 4,032 patches on a Zen 3, 0.39x on the
        avx512-nobf16 tier of a Zen 4 (docs/benchmarks.md sections 45 and 46)."""
        return self.lib is not None and self.has(native.AVX2) and dtype == torch.float32

    def vision_rope(self, dtype: torch.dtype) -> bool:
        return self._bf16_products(dtype)

    def _bf16_products(self, dtype: torch.dtype) -> bool:
        """bf16 data and a build with AVX512-BF16 dot products."""
        return self.lib is not None and dtype == torch.bfloat16 and self.has(native.BF16)

    def fused_elementwise(self, dtype: torch.dtype) -> bool:
        """Prefill's SiLU * up and text RoPE in one native pass each (bf16, rounded as the
        reference rounds; torch's ops took 0.35 s of a 1,114-token prefill: docs/benchmarks.md
        section 36); float32 keeps torch's."""
        return self._bf16_products(dtype)

    def rms_norm(self, dtype: torch.dtype) -> bool:
        return self.lib is not None and dtype == torch.bfloat16  # float32: torch's is as fast

    def decode_step(self, dtype: torch.dtype) -> bool:
        """All decoder layers of a decode step in one native call."""
        return self.lib is not None and dtype in (torch.bfloat16, torch.float32)

    @property
    def native_bf16(self) -> bool:
        """bf16 products run in hardware on this tier: bf16 is the default compute dtype."""
        return self.tier.bf16

    def describe(self) -> dict[str, str]:
        """What runs each kind of product (for `qvl info`)."""
        if self.lib is None:
            return {"tier": f"{self.tier.name} (native kernels off: {self.reason})",
                    "decode": "torch weight-only kernels / oneDNN", "attention": "torch SDPA",
                    "decode_step": "per-layer modules"}
        f, name = self.features, self.tier.name
        compute = torch.bfloat16 if self.native_bf16 else torch.float32  # the default compute dtype
        extras = [n for bit, n in ((native.VNNI, "VNNI"), (native.BF16, "BF16"), (native.AVX_VNNI, "AVX-VNNI"),
                                   (native.DOTPROD, "dot products"), (native.I8MM, "int8 matrix products"),
                                   (native.AMX_INT8, "AMX-INT8"))
                  if f & bit]
        byte = (("smmla" if f & native.I8MM else "sdot") if name.startswith("neon") else
                "vpdpbusd" if f & (native.VNNI | native.AVX_VNNI) else "vpmaddubsw")
        integer = {"avx512": "AVX-512" + (" VNNI" if f & native.VNNI else " (16-bit pairs)"),
                   "avx2": "AVX2 " + ("AVX-VNNI" if f & native.AVX_VNNI else "vpmaddwd / vpmaddubsw"),
                   "neon": "NEON smlal" + (" / sdot" if f & native.DOTPROD else "")}
        family = name.split("-")[0]
        products = integer.get(family, "portable C (compiler-vectorised)")
        return {
            "tier": name + (f" (+{', +'.join(extras)})" if extras else ""),
            "build": f"{native.compiler()} {' '.join(self.tier.flags)}" + ("" if f & native.OPENMP else
                                                                             " (no OpenMP: one thread)"),
            "gemv_int8": ("AMX int8 tiles (16 weight rows per operation)" if f & native.AMX_INT8 else products)
                         + ", activations in 16 bits per 128 columns",
            "prefill_int8_int4": "int8: AMX int8 tiles, activations in 16-bit codes per row; int4: AMX bf16 tiles, "
                                 "the weights converted panel by panel (up to 2^21 activation values)"
                                 if f & native.AMX_INT8 else
                                 (f"int8: byte products ({byte}), activations in 8-bit codes per "
                                  f"{native.ACTIVATION_GROUP} columns ("
                                  + ("16-bit codes per row in pair products" if self.i16_products(torch.float32)
                                     else "dequantise + float GEMM") + " with --int8-activations vision|off)"
                                  if self.default_int8_activations(compute) == "all" else
                                  "int8: 16-bit pair products (vpmaddwd), activations in 16-bit codes per row"
                                  + (f" (byte products ({byte}) in {self.q8_code_bits}-bit codes per {native.ACTIVATION_GROUP}"
                                     " columns with --int8-activations all)" if self.group_codes(compute) else ""))
                                 + "; int4: dequantise + float GEMM"
                                 if self.group_codes(compute) or self.i16_products(torch.float32)
                                 else "dequantise + float GEMM",
            "gemv_int4": f"{products if family != 'neon' or f & native.DOTPROD else 'portable C'}, "
                         "activations in int8 per 128 columns",
            "gemv_bf16": "float products" + ("" if family == "portable" else f" ({family})"),
            "decode_attention": "AVX512-BF16 (bf16 cache), float kernel (float32 cache)" if f & native.BF16
                                else "float kernel (compiler-vectorised)",
            "flash_attention": "AMX-BF16 flash kernel (head size <= 128)" if f & native.BF16 and f & native.AMX_INT8
                               else "AVX512-BF16 flash kernel" if f & native.BF16 else "torch SDPA (float32)",
            "vision_attention": "AMX-BF16 flash kernel (head size <= 128)" if self.vision_attention(torch.bfloat16)
                                and self.tier.amx else "as flash_attention" + (
                                    "; with int8 x int8 linears, vision in 8-bit codes (vpdpbusd, head size 64-80)"
                                    if self.byte_vision_attention(torch.bfloat16) else "") + (
                                    "; float32 with int8 x int8 linears: 16-bit integer pairs ("
                                    + ("vpdpwssd" if name.startswith("avx512") and f & native.VNNI else "vpmaddwd")
                                    + ", head size 64-80)" if self.integer_vision_attention(torch.float32) else ""),
            "decode_step": "all layers in one native call (bf16 and float32; mixtures of experts with a bf16 router)",
            "rms_norm": "native (bf16), torch (float32)",
            "int8_activations": (f"byte products ({byte}), activations in {self.q8_code_bits}-bit codes per {native.ACTIVATION_GROUP} "
                                 "columns, the vision blocks' norm, GELU and residual fused"
                                 if self.group_codes(compute) else
                                 ("AMX int8 tiles, each block rescaled in cache" if f & native.AMX_INT8 else
                                  "oneDNN's int8 GEMM (prepacked weights)") + " + native quantise/rescale, activations "
                                 f"per row in {'8' if self.int8_levels == 255 else '7'} bits") + (
                {"all": ", vision and prefill by default (prefill: prefill_int8_int4)",
                 "vision": ", vision by default (faster than the float GEMM here)",
                 "off": ", off by default (not faster than the float GEMM here)"}[self.default_int8_activations(compute)]),
        }


def _int8_gemm_is_exact(levels: int) -> bool:
    """native.int8_gemm on codes 0..levels (with all-levels and all-0 rows) and int8 weights
    (with all-127 and all-(-127) rows) equals the exact integer product."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, levels + 1, (32, 64), dtype=torch.uint8, generator=g)
    codes[0], codes[1] = levels, 0
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)
    w[0], w[1] = 127, -127
    try:
        got = native.int8_gemm(codes, native.pack_int8(w), 32)
    except (RuntimeError, AttributeError):  # no oneDNN int8 GEMM in this torch build
        return False
    return torch.equal(got.double(), codes.double() @ w.double().t())


def _load() -> Kernels:
    tier = native.select_tier()
    if os.environ.get("QVL_NATIVE", "1") == "0":
        return Kernels(tier, None, "QVL_NATIVE=0")
    try:
        return Kernels(tier, native.load(tier, paths.cache_root() / "native"))
    except (RuntimeError, OSError) as exc:
        print(f"qvl: native kernels unavailable, using torch's ({exc})", file=sys.stderr)
        return Kernels(tier, None, str(exc).splitlines()[0])


_chosen: list[Kernels] = []  # the one choice of this process, made on first use


def kernels() -> Kernels:
    """The kernels for this process: chosen and built (or loaded from the cache) on first use."""
    if not _chosen:
        _chosen.append(_load())
    return _chosen[0]
