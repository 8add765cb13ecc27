"""Building qvl's native kernels (csrc/*.c) for this machine and opening them with ctypes.

Each build targets one instruction-set tier (see Tier): AVX-512 (+VNNI, +BF16), AVX2 + FMA
(+AVX-VNNI), ARM NEON (+dot products) or portable C. It is compiled with the system C compiler
into the qvl cache, keyed by the sources, the compiler, the tier's flags and the CPU's feature
list, and reused by later starts. OpenMP is used where the compiler has it (not Apple's clang):
without it the kernels run on one thread. Which build this process runs is qvl.kernels.library's
choice; what runs each layer, qvl.kernels.plan's."""

from __future__ import annotations

import ctypes
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

SOURCE_DIR = Path(__file__).parent.parent / "csrc"
W_BF16, W_INT8, W_INT4 = 0, 1, 2  # weight formats (common.h)
# bits of qvl_features(): what the build has
AVX512, VNNI, BF16, AVX2, AVX_VNNI, NEON, DOTPROD, OPENMP, AMX_INT8, I8MM = 1, 2, 4, 8, 16, 32, 64, 128, 256, 512
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes
LIBRARY_SUFFIX = {"win32": ".dll", "darwin": ".dylib"}.get(sys.platform, ".so")


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a ctypes call (None: NULL)."""
    return None if t is None else t.data_ptr()


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
    """The built library at `path`, its functions typed; `features` and `q8_levels` read once."""
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
    lib.qvl_rmsnorm_zero_centred.argtypes = [ptr, ptr, ptr, c_int, i64, i64, ctypes.c_float, c_int]
    lib.qvl_rmsnorm_zero_centred.restype = None
    lib.qvl_gated_rmsnorm.argtypes = [ptr, ptr, ptr, ptr, c_int, i64, i64, ctypes.c_float, c_int]
    lib.qvl_gated_rmsnorm.restype = None
    lib.qvl_silu_mul.argtypes = [ptr, ptr, c_int, i64, c_int]
    lib.qvl_silu_mul.restype = None
    lib.qvl_text_rope.argtypes = [ptr, c_int, i64, i64, i64, i64, i64, ptr, ptr, ptr, c_int]
    lib.qvl_text_rope.restype = c_int
    lib.qvl_decode_layers.argtypes = [ptr, i64, ptr, ptr, c_int, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64,
                                      ptr, ptr, c_int]
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
    lib.qvl_q4_linear.argtypes = [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, c_int, c_int]
    lib.qvl_q4_linear.restype = c_int
    lib.qvl_gated_delta_rule.argtypes = [ptr, ptr, ptr, c_int] + [i64] * 11 + [ptr, ptr, ptr, ptr, i64, i64, c_int]
    lib.qvl_gated_delta_rule.restype = c_int
    lib.qvl_gated_delta_step.argtypes = [ptr, ptr, ptr, c_int] + [i64] * 11 + [ptr, ptr, ptr, ptr, ptr, c_int]
    lib.qvl_gated_delta_step.restype = c_int
    lib.qvl_causal_conv.argtypes = [ptr, c_int, i64, i64, i64, ptr, i64, ptr, ptr, c_int]
    lib.qvl_causal_conv.restype = c_int
    lib.qvl_causal_conv_step.argtypes = [ptr, c_int, i64, i64, i64, ptr, i64, ptr, ptr, ptr, c_int]
    lib.qvl_causal_conv_step.restype = c_int
    lib.qvl_amx_pack_int8.argtypes = [ptr, i64, i64, ptr]
    lib.qvl_amx_pack_int8.restype = None
    lib.qvl_team_counts.argtypes = [ptr]
    lib.qvl_team_counts.restype = None
    lib.qvl_team_place.argtypes = [c_int, ptr, ptr, ptr]
    lib.qvl_team_place.restype = c_int
    lib.qvl_team_check.argtypes = [c_int, i64, c_int, c_int, c_int, ptr, ptr]
    lib.qvl_team_check.restype = i64
    lib.qvl_q8_levels.argtypes = []
    lib.qvl_q8_levels.restype = c_int
    lib.qvl_features.argtypes = []
    lib.qvl_features.restype = c_int
    lib.features = lib.qvl_features()  # fixed for the build: read once, not per call
    lib.q8_levels = lib.qvl_q8_levels()  # the byte kernel's top activation code (0: not built)
    return lib


def load(tier: Tier, cache: Path) -> ctypes.CDLL:
    """The kernels built for `tier` (compiled into `cache` the first time)."""
    return open_library(build(cache, tier))

