"""qvl's native kernels (csrc/*.c): built for this machine's CPU on first use, called through
ctypes (which releases the GIL while they run).

Each build targets one instruction-set tier (see Tier): AVX-512 (+VNNI, +BF16), AVX2 + FMA
(+AVX-VNNI), ARM NEON (+dot products) or portable C. It is compiled with the system C compiler
into the qvl cache, keyed by the sources, the compiler, the tier's flags and the CPU's feature
list, and reused by later starts (a few seconds to build, once). OpenMP is used where the
compiler has it (not Apple's clang): without it the kernels run on one thread. Which build
runs, and what runs each product, is decided once in qvl.dispatch."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qvl.runtime import cpu_flags

SOURCE_DIR = Path(__file__).with_name("csrc")
W_BF16, W_INT8, W_INT4 = 0, 1, 2
ACTIVATION_GROUP = 64  # columns per scale of prefill's 8-bit activation codes (docs/benchmarks.md section 40)
GEMV_MAX_ROWS = 16  # up to this many activation rows the GEMV kernels beat dequantise + GEMM (int8 on AMX: 64)
# bits of qvl_features(): what the build has
AVX512, VNNI, BF16, AVX2, AVX_VNNI, NEON, DOTPROD, OPENMP, AMX_INT8, I8MM = 1, 2, 4, 8, 16, 32, 64, 128, 256, 512
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LIBRARY_SUFFIX = {"win32": ".dll", "darwin": ".dylib"}.get(sys.platform, ".so")


@dataclass(frozen=True)
class Tier:
    """One instruction-set tier: its name (what QVL_ISA takes), the CPU flags it needs, and the
    compiler flags that select it (on top of the machine's own -march/-mcpu)."""

    name: str
    needs: frozenset[str]
    flags: tuple[str, ...]
    bf16: bool = False  # bf16 products in hardware (AVX512-BF16 / AMX): bf16 compute is the default
    amx: bool = False  # AMX tiles: torch's oneDNN GEMMs and SDPA use them (faster than qvl's flash kernel)


def tiers(flags: frozenset[str] | None = None, machine: str | None = None) -> list[Tier]:
    """The tiers this CPU can run, best first. x86: avx512 (as the CPU has it), avx512-nobf16,
    avx2-vnni, avx2, portable; ARM: neon, neon-nodotprod, portable."""
    flags = cpu_flags() if flags is None else flags
    machine = (machine or platform.machine()).lower()
    if machine in ("arm64", "aarch64"):
        dot = "asimddp" in flags or sys.platform == "darwin"  # every Apple silicon CPU has dot products
        found = [Tier("neon", frozenset(), ("-mcpu=native",))] if dot else []
        return found + [Tier("neon-nodotprod", frozenset(), ("-mcpu=native+nodotprod",) if dot else ("-mcpu=native",)),
                        Tier("portable", frozenset(), ("-DQVL_PORTABLE",))]
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl"})
    bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    amx = "amx_bf16" in flags
    x86 = [Tier("avx512", avx512, ("-march=native",), bf16=bf16, amx=amx),
           # an AMX CPU run as one without (Zen 4, Ice Lake): with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 for torch
           *([Tier("avx512-noamx", avx512, ("-march=native", "-mno-amx-tile"), bf16=bf16)] if amx and bf16 else []),
           Tier("avx512-nobf16", avx512, ("-march=native", "-mno-avx512bf16") + (("-mno-amx-tile",) if amx else ())),
           Tier("avx2-vnni", frozenset({"avx2", "fma", "avx_vnni"}), ("-march=native", "-mno-avx512f")),
           Tier("avx2", frozenset({"avx2", "fma"}), ("-march=native", "-mno-avx512f", "-mno-avxvnni"))]
    found = [t for t in x86 if t.needs <= flags]
    if found and found[0].name == "avx512" and not bf16:
        found = found[1:]  # avx512 without BF16 is avx512-nobf16: one name per kind of build
    return found + [Tier("portable", frozenset(), ("-march=native", "-DQVL_PORTABLE"))]


def select_tier(override: str | None = None) -> Tier:
    """The best tier for this CPU, or the one QVL_ISA names (it must be one the CPU can run)."""
    available = tiers()
    name = override if override is not None else os.environ.get("QVL_ISA", "")
    if not name or name == "native":
        return available[0]
    for tier in available:
        if tier.name == name:
            return tier
    raise ValueError(f"QVL_ISA={name} is not a tier this CPU can run (choose from "
                     f"{', '.join(t.name for t in available)})")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))


def library_name(tier: Tier, compiler_version: str) -> str:
    """The built library's file name, keyed by the sources, the tier, the compiler and the CPU's
    flags; the same in every process (no set's iteration order, which string hashing randomises
    per process, goes into it)."""
    described = f"{tier.name}|{sorted(tier.needs)}|{tier.flags}|{tier.bf16}|{tier.amx}"
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources()) + described.encode() + compiler_version.encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return f"qvl_kernels-{tier.name}-{key}{LIBRARY_SUFFIX}"


UNUSED_LIBRARY_DAYS = 30  # a built library no start has loaded for this long is removed


def _mark_used(lib: Path) -> bool:
    """Mark `lib` used now and remove the libraries beside it that no start has loaded for
    UNUSED_LIBRARY_DAYS (one per qvl version, compiler and tier ever run; a process still
    running one keeps its mapping). False when `lib` itself is gone (another process removed
    it a moment ago: build it again). Best effort otherwise: a file that cannot be removed stays."""
    try:
        os.utime(lib)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    cutoff = time.time() - UNUSED_LIBRARY_DAYS * 86400
    for other in lib.parent.glob(f"qvl_kernels-*{LIBRARY_SUFFIX}"):
        try:
            if other != lib and other.stat().st_mtime < cutoff:
                other.unlink()
        except OSError:
            pass
    return True


def build(out_dir: Path, tier: Tier, cc: str | None = None) -> Path:
    """Compile the kernels for `tier` into out_dir (atomically) and return the library's path.
    OpenMP where the compiler has it, else its SIMD pragmas only, else neither. Raises
    RuntimeError with the compiler's message when no variant compiles."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    lib = out_dir / library_name(tier, version)
    if lib.exists() and _mark_used(lib):
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=out_dir, suffix=LIBRARY_SUFFIX + ".partial")
    os.close(fd)
    errors = []
    try:
        for threads in (["-fopenmp"], ["-fopenmp-simd"], []):
            cmd = [cc, "-O3", *tier.flags, "-fno-math-errno", *threads, "-fPIC", "-shared",
                   *map(str, sorted(SOURCE_DIR.glob("*.c"))), "-o", partial, "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(partial, lib)  # other processes see the whole library or none
                _mark_used(lib)
                return lib
            errors.append(done.stderr.strip())
        raise RuntimeError(f"compiling the kernels for {tier.name} failed:\n{errors[0]}")
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.qvl_linear.argtypes = [c_int, ptr, c_int, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, c_int]
    lib.qvl_linear.restype = c_int
    lib.qvl_dequantize.argtypes = [c_int, ptr, ptr, ptr, i64, i64, i64, c_int, ptr, c_int]
    lib.qvl_dequantize.restype = None
    lib.qvl_quantize_rows.argtypes = [ptr, c_int, i64, i64, c_int, ptr, ptr, ctypes.c_float, ptr, i64, ptr, ptr, c_int]
    lib.qvl_quantize_rows.restype = c_int
    lib.qvl_rescale.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, c_int, i64, i64, c_int, ptr, ptr, c_int]
    lib.qvl_rescale.restype = c_int
    lib.qvl_attention.argtypes = [ptr, ptr, ptr, ptr] + [i64] * 14 + [ptr, i64, i64, c_int]
    lib.qvl_attention.restype = c_int
    if hasattr(lib, "qvl_attention_q8"):  # every build has it; older checkouts' (benchmarks' --before) do not
        lib.qvl_attention_q8.argtypes = [ptr, ptr, ptr, ptr] + [i64] * 12 + [c_int]
        lib.qvl_attention_q8.restype = c_int
    lib.qvl_attention_i16.argtypes = [ptr, ptr, ptr, ptr] + [i64] * 12 + [ptr, ptr, i64, c_int]
    lib.qvl_attention_i16.restype = c_int
    lib.qvl_decode_attention.argtypes = [ptr, ptr, ptr, c_int, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr,
                                         c_int]
    lib.qvl_decode_attention.restype = c_int
    lib.qvl_vision_rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, c_int]
    lib.qvl_vision_rope.restype = c_int
    lib.qvl_rmsnorm.argtypes = [ptr, ptr, ptr, c_int, i64, i64, ctypes.c_float, c_int]
    lib.qvl_rmsnorm.restype = None
    lib.qvl_silu_mul.argtypes = [ptr, ptr, c_int, i64, c_int]
    lib.qvl_silu_mul.restype = None
    lib.qvl_text_rope.argtypes = [ptr, c_int, i64, i64, i64, i64, i64, ptr, ptr, ptr, c_int]
    lib.qvl_text_rope.restype = c_int
    lib.qvl_decode_layers.argtypes = [ptr, i64, ptr, c_int, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr,
                                      ptr, ptr, i64, ptr, i64, i64, i64, i64, ptr, c_int]
    lib.qvl_decode_layers.restype = c_int
    lib.qvl_amx_bf16_linear.argtypes = [c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, c_int, ptr, c_int]
    lib.qvl_amx_bf16_linear.restype = c_int
    lib.qvl_amx_int8_matmul.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, c_int, c_int, ptr, ptr, c_int]
    lib.qvl_amx_int8_matmul.restype = c_int
    lib.qvl_amx_i16_linear.argtypes = [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, ptr, c_int]
    lib.qvl_amx_i16_linear.restype = c_int
    lib.qvl_i16_linear.argtypes = [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, ptr, c_int]
    lib.qvl_i16_linear.restype = c_int
    lib.qvl_q8_linear.argtypes = [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, ptr, c_int, c_int, ptr, ptr, ctypes.c_float,
                                  c_int, ptr]
    lib.qvl_q8_linear.restype = c_int
    lib.qvl_amx_pack_int8.argtypes = [ptr, i64, i64, ptr]
    lib.qvl_amx_pack_int8.restype = None
    if hasattr(lib, "qvl_q8_levels"):  # every build has it; older checkouts' (benchmarks' --before) do not
        lib.qvl_q8_levels.argtypes = []
        lib.qvl_q8_levels.restype = c_int
    lib.qvl_features.argtypes = []
    lib.qvl_features.restype = c_int
    lib.features = lib.qvl_features()  # fixed for the build: read once, not per call
    # the byte kernel's top activation code (0: not built); before qvl_q8_levels it was built, in
    # 8-bit codes, only with VNNI, AVX-VNNI or ARM's dot products
    lib.q8_levels = lib.qvl_q8_levels() if hasattr(lib, "qvl_q8_levels") else (
        127 if lib.features & (VNNI | AVX_VNNI | DOTPROD) else 0)
    return lib


def load(tier: Tier, cache: Path) -> ctypes.CDLL:
    """The kernels built for `tier` (compiled into `cache` the first time)."""
    return open_library(build(cache, tier))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(lib: ctypes.CDLL, kind: int, x: torch.Tensor, weight: torch.Tensor, out_features: int,
           scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, group_size: int = 0,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] float32/bf16 -> [..., out_features] in x's dtype. Float arguments
    (scale, zero, bias) must have x's dtype; every tensor must be contiguous."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    status = lib.qvl_linear(kind, rows.data_ptr(), _DTYPES[x.dtype], rows.shape[0], k, out_features,
                            weight.data_ptr(), _ptr(scale), _ptr(zero), group_size, _ptr(bias), y.data_ptr(),
                            torch.get_num_threads())
    if status != 0:
        raise MemoryError("qvl_linear could not allocate its activation buffers")
    return y.view(*x.shape[:-1], out_features)


AMX_BF16_MAX_VALUES = 1 << 21  # amx.c's MAX_ACTIVATIONS


def amx_bf16_linear(lib: ctypes.CDLL, kind: int, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor | None = None, group_size: int = 0,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 @ the int8 (W_INT8: [N, K], a scale per row) or int4 (W_INT4: nibbles
    [N, K/2], a scale and a zero per group) weight's transpose (+ bias) -> [..., N] bf16 on AMX
    tiles, the weight converted to bf16 panel by panel (many rows: prefill); None where the
    kernel does not run (no AMX, K or N not a multiple of 32, int4 groups not a multiple of 32,
    more than 2^21 activation values, tensors not contiguous or scale/zero/bias dtypes apart)."""
    k, n = x.shape[-1], weight.shape[0]
    if x.numel() > AMX_BF16_MAX_VALUES or k % 32 or n % 32 or not weight.is_contiguous():
        return None
    if kind == W_INT4 and (zero is None or group_size <= 0 or group_size % 32):
        return None
    if not all(t is None or (t.dtype == scale.dtype and t.is_contiguous()) for t in (scale, zero, bias)):
        return None  # the kernel reads them as one contiguous dtype
    assert x.dtype == torch.bfloat16 and weight.dtype == (torch.int8 if kind == W_INT8 else torch.uint8)
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    status = lib.qvl_amx_bf16_linear(kind, rows.data_ptr(), rows.shape[0], k, n, weight.data_ptr(), scale.data_ptr(),
                                     _ptr(zero), group_size, _ptr(bias), _DTYPES[scale.dtype], y.data_ptr(),
                                     torch.get_num_threads())
    return y.view(*x.shape[:-1], n) if status == 1 else None


def amx_i16_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 @ (weight [N, K] int8 * scale [N]).T (+ bias) -> [..., N] on AMX int8
    tiles, x in 16-bit codes per row (amx.c's qvl_amx_i16_linear); None where that kernel does
    not run (no AMX tiles, K not a multiple of 64, N not a multiple of 16)."""
    return _int8_rows(lib.qvl_amx_i16_linear, x, weight, scale, bias, (torch.bfloat16,), 64)


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
    codes per row, on AVX-512 or AVX2 integer pair products (i16_gemm.c's qvl_i16_linear);
    None where that kernel does not run (other tiers, K odd, N not a multiple of 16)."""
    return _int8_rows(lib.qvl_i16_linear, x, weight, scale, bias, tuple(_DTYPES), 2)


def q8_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, group: int = ACTIVATION_GROUP, gelu_tanh: bool = False,
              residual: torch.Tensor | None = None, layer_norm: LayerNormArgs | None = None) -> torch.Tensor | None:
    """x [..., K] @ (weight [N, K] int8 * scale [N]).T (+ bias) -> [..., N] with x in 8-bit
    codes per `group` columns, on byte products (i16_gemm.c's qvl_q8_linear: VNNI, ARM's sdot or
    i8mm); None where that kernel does not run (no such products, K or the group not a multiple
    of 4 (of 8 with i8mm), N not a multiple of 16).
    `layer_norm`, `gelu_tanh` and `residual` are fused into it as int8_matmul's are."""
    norm_w, norm_b, eps, residual = _fusions(x, scale.shape[0], residual, layer_norm)
    return _int8_rows(lib.qvl_q8_linear, x, weight, scale, bias, tuple(_DTYPES), 4, group, _ptr(norm_w),
                      _ptr(norm_b), eps, int(gelu_tanh), _ptr(residual))


def _int8_rows(fn, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               dtypes: tuple[torch.dtype, ...], k_step: int, *extra) -> torch.Tensor | None:
    """A many-row int8 product kernel taking (x, dt, M, K, N, w, scale, bias, y, threads, *extra): None
    for shapes or dtypes it does not take (scale and bias must be x's dtype), or when it says -2."""
    k, n = x.shape[-1], weight.shape[0]
    if x.dtype not in dtypes or k % k_step or n % 16 or weight.dtype != torch.int8 or weight.shape[1] != k:
        return None
    if not weight.is_contiguous() or scale.dtype != x.dtype or not scale.is_contiguous() or scale.numel() != n or (
            bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != n)):
        return None
    rows = x.reshape(-1, k).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype)
    status = fn(rows.data_ptr(), _DTYPES[x.dtype], rows.shape[0], k, n, weight.data_ptr(), scale.data_ptr(),
                _ptr(bias), y.data_ptr(), torch.get_num_threads(), *extra)
    if status == -1:
        raise MemoryError(f"{fn.__name__} could not allocate its activation codes")
    return y.view(*x.shape[:-1], n) if status == 0 else None


def dequantize(lib: ctypes.CDLL, kind: int, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               group_size: int, shape: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """An int8/int4 weight -> [N, K] in the scales' dtype (into `out`, contiguous, when
    given), in one multi-threaded pass."""
    if out is None:
        out = torch.empty(shape, dtype=scale.dtype)
    lib.qvl_dequantize(kind, weight.data_ptr(), scale.data_ptr(), _ptr(zero), group_size, shape[0], shape[1],
                       _DTYPES[scale.dtype], out.data_ptr(), torch.get_num_threads())
    return out


# int8_matmul runs oneDNN's GEMM on blocks of rows whose float32 product fits 8 MB (512 rows
# of vision fc1): fc1 on 3968 patches 2.1x faster on AMX than in one call, 1.2x on AVX2; never
# fewer than 256 rows (the per-call cost). docs/benchmarks.md, section 26. Equal blocks (1008
# rows as 3 x 336, not 487 + 487 + 34) were tried and were slower: oneDNN ran 336 rows at 1.07
# TOPS against 1.47 at 487 (section 35).
INT8_GEMM_OUTPUT_FLOATS = 2 << 20
INT8_GEMM_MIN_ROWS = 256


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 -> oneDNN's prepacked copy of it for int8_gemm (an opaque tensor)."""
    return torch.ops.onednn.qlinear_prepack(weight, None)


def amx_pack_int8(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 (N % 16 == 0) -> its AMX tiles for int8_matmul(amx=True): [N, Kp] int8,
    K zero-padded to Kp, a multiple of 64 (amx.c's qvl_amx_pack_int8 layout)."""
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
    m, threads, dt = rows.shape[0], torch.get_num_threads(), _DTYPES[x.dtype]
    # the AMX kernel reads whole tiles: rows padded to 32 and columns to 64 with zero codes
    kp = packed.shape[1] if amx else k
    codes = torch.empty(-(-m // 32) * 32 if amx else m, kp, dtype=torch.uint8)
    codes[m:] = 0
    row_scale, row_lo = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.float32)
    if lib.qvl_quantize_rows(rows.data_ptr(), dt, m, k, levels, _ptr(norm_w), _ptr(norm_b),
                             eps, codes.data_ptr(), kp, row_scale.data_ptr(),
                             row_lo.data_ptr(), threads) != 0:
        raise MemoryError("qvl_quantize_rows could not allocate its row buffers")
    y = torch.empty(m, n, dtype=x.dtype)
    if amx:
        status = lib.qvl_amx_int8_matmul(codes.data_ptr(), packed.data_ptr(), m, kp, n, row_scale.data_ptr(),
                                         row_lo.data_ptr(), colsums.data_ptr(), scale.data_ptr(), _ptr(bias), dt,
                                         int(gelu_tanh), _ptr(residual), y.data_ptr(), threads)
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
                           scale.data_ptr(), _ptr(bias), dt, r1 - r0, n, int(gelu_tanh),
                           None if residual is None else residual[r0:].data_ptr(), y[r0:].data_ptr(), threads) != 0:
            raise MemoryError("qvl_rescale could not allocate its scale buffers")
    return y.view(*x.shape[:-1], n)


def attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal_from: int | None = None) -> torch.Tensor | None:
    """Attention of T queries over S keys (AVX512-BF16 builds): q [T, H, D], k and v
    [S, H_kv, D] bf16 (any token/head strides, D contiguous) -> [T, H, D] contiguous.
    causal_from=None: every query sees every key (vision); an int p: query t sits at position
    p + t and sees keys 0..p+t (prefill over a cache). Head sizes: on AMX tiles where the CPU
    has them any even D up to 128, else 32, 64 or 128 (vision also 72 and 80). None when the
    shapes do not apply."""
    t, h, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    if d % 2 or h % hkv or any(x.dtype != torch.bfloat16 or x.stride(2) != 1 for x in (q, k, v)):
        return None
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    status = lib.qvl_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, s, h, hkv, d,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               out.stride(0), out.stride(1), -1 if causal_from is None else causal_from, None, 0, 0,
                               torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_attention could not allocate its packed keys and values")
    return out if status == 0 else None


def attention_q8(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """Full attention (the vision tower: no mask) in 8-bit integer codes (AVX-512 builds with VNNI
    and BF16): scores from keys centred over the image with a step per 64 keys and queries with a
    step per row, P and V with a step per 64 keys (per row and per channel), every product on
    vpdpbusd. q [T, H, D], k and v [S, H, D] bf16 (any token/head strides, D contiguous; D 64, 72
    or 80) -> [T, H, D] contiguous. None when the shapes do not apply or an input holds a NaN or
    an infinity."""
    t, h, d = q.shape
    s = k.shape[0]
    if k.shape[1] != h or v.shape[1] != h or any(x.dtype != torch.bfloat16 or x.stride(2) != 1 for x in (q, k, v)):
        return None
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    status = lib.qvl_attention_q8(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, s, h, d,
                                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                  out.stride(0), out.stride(1), torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_attention_q8 could not allocate its packed keys and values")
    return out if status == 0 else None


def attention_i16(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None = None,
                  sin: torch.Tensor | None = None) -> torch.Tensor | None:
    """Full attention (the vision tower: no mask) with the products in 16-bit integer codes
    (AVX2 and AVX-512 builds): q [T, H, D], k and v [S, H, D] float32 (any token/head strides,
    D contiguous; D 64, 72 or 80) -> [T, H, D] contiguous. cos, sin (the tower's RoPE tables,
    [S, 1, D] or [S, D] float32): q and k are not rotated yet and the kernel rotates them as it
    codes them (T == S). None when the shapes do not apply or an input holds a NaN or an
    infinity (the float path carries those as the reference does)."""
    t, h, d = q.shape
    s = k.shape[0]
    if k.shape[1] != h or v.shape[1] != h or any(x.dtype != torch.float32 or x.stride(2) != 1 for x in (q, k, v)):
        return None
    tables = None
    if cos is not None:
        tables = [x.reshape(x.shape[0], -1) for x in (cos, sin)]
        if t != s or any(x.shape != (s, d) or x.dtype != torch.float32 or x.stride(1) != 1 for x in tables) \
                or tables[0].stride(0) != tables[1].stride(0):
            return None
    out = torch.empty(t, h, d)
    status = lib.qvl_attention_i16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, s, h, d,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   out.stride(0), out.stride(1), *((x.data_ptr() for x in tables) if tables else
                                                                   (None, None)),
                                   tables[0].stride(0) if tables else 0, torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_attention_i16 could not allocate its packed keys and values")
    return out if status == 0 else None


def check_table(table: torch.Tensor, lengths: torch.Tensor, block: int, blocks: int, what: str) -> None:
    """Raise IndexError unless the blocks holding each row's first lengths[b] positions
    (table [B, max_blocks], -1 past a row's blocks) are all in a pool of `blocks` blocks: the
    kernels read and write through the table unchecked."""
    held = torch.arange(table.shape[1])[None] < ((lengths + block - 1) // block)[:, None]
    if int(lengths.max()) > table.shape[1] * block or bool(((table < 0) & held).any()) or int(table.max()) >= blocks:
        raise IndexError(f"{what}: a position outside its row's blocks")


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    blocks: torch.Tensor, causal_from: int) -> torch.Tensor | None:
    """Causal prefill attention of one row over the paged cache (AVX512-BF16 builds; on AMX
    tiles where the CPU has them): q
    [T, H, D] bf16 (any token/head strides, D contiguous) at positions causal_from.. over
    that row's keys and values, one layer of the pool [blocks, H_kv, BLOCK, D], position j in
    block blocks[j // BLOCK] ([>= ceil((causal_from + T) / BLOCK)] int64) -> [T, H, D]
    contiguous. None when the shapes do not apply."""
    t, h, d = q.shape
    n, hkv, block = keys.shape[0], keys.shape[1], keys.shape[2]
    if d % 2 or h % hkv or any(x.dtype != torch.bfloat16 or x.stride(-1) != 1 for x in (q, keys, values)):
        return None
    if keys.stride() != values.stride() or keys.stride(2) != d or not keys.is_contiguous():
        return None
    s = causal_from + t
    used = blocks[: -(-s // block)].to(torch.int64).contiguous()
    check_table(used[None], torch.tensor([s]), block, n, "paged attention")
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    status = lib.qvl_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), t, s, h, hkv, d,
                               q.stride(0), q.stride(1), d, keys.stride(1), d, values.stride(1), out.stride(0),
                               out.stride(1), causal_from, used.data_ptr(), block, keys.stride(0),
                               torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_attention could not allocate its packed keys and values")
    return out if status == 0 else None


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
    """One query per row over the paged cache: q [B, H, 1, D]; keys/values one layer of the
    pool [blocks, Hkv, BLOCK, D], all bf16 or all float32; batch row b reads its first
    lengths[b] positions ([B] int64, >= 1), position j in block table[b, j // BLOCK] (table
    [B, max_blocks] int64) -> [B, H, 1, D]. None when the shapes do not apply (then use SDPA)."""
    b, h, _, d = q.shape
    n, hkv, block = keys.shape[0], keys.shape[1], keys.shape[2]
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        return None
    if keys.stride() != values.stride() or not keys.is_contiguous():
        return None
    q = q.contiguous()
    table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    check_table(table, lengths, block, n, "decode attention")
    out = torch.empty(b, h, 1, d, dtype=q.dtype)
    status = lib.qvl_decode_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), _DTYPES[q.dtype],
                                      table.data_ptr(), table.shape[1], block, keys.stride(0), keys.stride(1), b, h,
                                      hkv, lengths.data_ptr(), d, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_decode_attention could not allocate its scores")
    return out if status == 0 else None


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
                                 out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (bf16 or float32) with a weight of the same dtype, in one
    call (the reference's seven small ops cost ~19 us per decode-step norm)."""
    rows = x.contiguous()
    out = torch.empty_like(rows)
    lib.qvl_rmsnorm(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), _DTYPES[x.dtype],
                    rows.numel() // rows.shape[-1], rows.shape[-1], eps, torch.get_num_threads())
    return out


def silu_mul(lib: ctypes.CDLL, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u (bf16 or float32, the same shape), rounded as the reference rounds it (after
    the SiLU and after the product), in one pass; returns g's storage (overwritten) when g is
    contiguous, else a new tensor."""
    if g.shape != u.shape or g.dtype != u.dtype or g.dtype not in _DTYPES:
        raise ValueError(f"silu_mul takes two tensors of one shape and dtype, not {tuple(g.shape)} {g.dtype} and "
                         f"{tuple(u.shape)} {u.dtype}")
    g, u = g.contiguous(), u.contiguous()
    lib.qvl_silu_mul(g.data_ptr(), u.data_ptr(), _DTYPES[g.dtype], g.numel(), torch.get_num_threads())
    return g


def text_rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Prefill's rotary embedding of one row: x [1, H, T, D] (any head/token strides, D
    contiguous), cos/sin [1, 1, T, D] of x's dtype -> x * cos + rotate_half(x) * sin as [1, H, T, D]
    (a view of a [T, H, D] tensor), rounded as the reference rounds it. None when the shapes or
    dtypes do not apply."""
    b, h, t, d = x.shape
    if b != 1 or x.stride(3) != 1 or x.dtype not in _DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    if cos.numel() != t * d or sin.numel() != t * d:
        return None
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    out = torch.empty(t, h, d, dtype=x.dtype)
    if lib.qvl_text_rope(x.data_ptr(), _DTYPES[x.dtype], t, h, d, x.stride(2), x.stride(1), cos.data_ptr(),
                         sin.data_ptr(), out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out.transpose(0, 1)[None]


class LinearArgs(ctypes.Structure):
    """One linear layer as the decode-step kernel reads it (QvlLinear in kernels.c)."""

    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]

    @classmethod
    def of(cls, kind: int, out_features: int, in_features: int, weight: torch.Tensor, scale=None, zero=None,
           group_size: int = 0, bias=None) -> LinearArgs:
        args = cls(kind, out_features, in_features, group_size, weight.data_ptr(), _ptr(scale), _ptr(zero), _ptr(bias))
        args.tensors = [t for t in (weight, scale, zero, bias) if t is not None]  # the pointers stay valid
        args.dtype = weight.dtype if kind == W_BF16 else scale.dtype  # the compute dtype it expects
        return args


class MoeArgs(ctypes.Structure):
    """A mixture-of-experts MLP as the decode-step kernel reads it (QvlMoe in common.h): the
    router, and arrays of the experts' gate_up and down linears; experts 0 in a dense layer."""

    _fields_ = [("experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("router", LinearArgs), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p)]

    @classmethod
    def of(cls, top_k: int, inter: int, router: LinearArgs, gate_up: list[LinearArgs],
           down: list[LinearArgs]) -> MoeArgs:
        arrays = [(LinearArgs * len(gate_up))(*gate_up), (LinearArgs * len(down))(*down)]
        args = cls(len(gate_up), top_k, inter, router, ctypes.addressof(arrays[0]), ctypes.addressof(arrays[1]))
        args.tensors = [arrays] + router.tensors + [t for a in gate_up + down for t in a.tensors]
        return args


class LayerArgs(ctypes.Structure):
    """One decoder layer's weights (QvlLayer in common.h)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)] + [(name, LinearArgs) for name in
                                                ("q", "k", "v", "o", "gate", "up", "down")] + [("moe", MoeArgs)]


def decode_layers(lib: ctypes.CDLL, layers: ctypes.Array, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache, slots: torch.Tensor, *, heads: int, head_dim: int, intermediate: int,
                  eps: float) -> torch.Tensor | None:
    """One decode step through every decoder layer in a single call (the per-op path spends
    ~8 ms per token in Python and small torch ops on the 2B model). h: [B, 1, D] bf16 or
    float32, and cos/sin [B, 1, 1, hd], the cache's pool [L, blocks, Hkv, BLOCK, hd] and the
    layers' float tensors of the same dtype; batch row b (block table row b of the
    kv_cache.KVCache `cache`) is written at position slots[b] ([B] int64) and attends to its
    positions 0..slots[b]; IndexError when its block table does not hold them. Returns the new hidden states [B, 1, D],
    or None when the kernel does not apply (nothing written)."""
    b, _, d = h.shape
    keys, values = cache.pool.keys, cache.pool.values
    if not keys.is_contiguous() or keys.stride() != values.stride():
        return None
    table, slots = cache.table.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    check_table(table, slots + 1, keys.shape[3], keys.shape[1], "decode step")
    x = h.clone(memory_format=torch.contiguous_format)
    cos, sin = cos.reshape(b, head_dim).contiguous(), sin.reshape(b, head_dim).contiguous()
    status = lib.qvl_decode_layers(
        ctypes.byref(layers), len(layers), x.data_ptr(), _DTYPES[h.dtype], b, d, heads, keys.shape[2], head_dim,
        intermediate, eps, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
        table.data_ptr(), table.shape[1], keys.shape[3], keys.stride(1), keys.stride(2), slots.data_ptr(),
        torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_decode_layers could not allocate its buffers")
    return x if status == 0 else None
