"""The native library this process runs: chosen once, on first use, from the CPU (or QVL_ISA).

QVL_ISA=avx512|avx512-nobf16|avx2-vnni|avx2|neon|neon-nodotprod|portable forces a tier this
CPU can run (tests and benchmarks use it, with torch's ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA
and MKL_ENABLE_INSTRUCTIONS, to emulate an older CPU); QVL_NATIVE=0 turns the native kernels off.
What runs each layer on it is qvl.kernels.plan's decision."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass

import torch

from qvl import paths
from qvl.kernels import build
from qvl.kernels.linear import int8_gemm, pack_int8


@dataclass(frozen=True)
class Library:
    """A tier, its built library (None: torch's kernels everywhere) and what the build has."""

    tier: build.Tier
    lib: ctypes.CDLL | None
    reason: str = ""  # why lib is None

    @property
    def features(self) -> int:
        return self.lib.features if self.lib is not None else 0

    def has(self, bit: int) -> bool:
        return bool(self.features & bit)

    @property
    def q8_levels(self) -> int:
        """The byte kernel's top activation code: 127 (8-bit codes) with VNNI, AVX-VNNI or ARM's
        dot products; 63 (7-bit) on plain AVX2, whose vpmaddubsw sums pairs of products in 16
        bits; 0 where the build has no byte kernel."""
        return self.lib.q8_levels if self.lib is not None else 0

    @property
    def q8_code_bits(self) -> int:
        """The byte kernel's activation codes in bits, sign included: 8, 7 on plain AVX2, 0 (no kernel)."""
        return (self.q8_levels + 1).bit_length() if self.q8_levels else 0

    def team_counts(self) -> tuple[int, int]:
        """The pieces of work qvl's kernels have done since the process started, and how many of
        them a waiting thread took over from one that had stopped (a core another program took)."""
        if self.lib is None:
            return 0, 0
        counts = (ctypes.c_int64 * 2)()
        self.lib.qvl_team_counts(counts)
        return counts[0], counts[1]

    def place_team(self, cpus: list[tuple[int, ...]]) -> list[int] | None:
        """Thread t of the calling thread's pool (qvl's kernels and torch's ops: len(cpus) threads)
        on the CPUs cpus[t] from now on; the threads' ids, or None where threads cannot be placed
        (no library, not Linux)."""
        if self.lib is None or not cpus:
            return None
        flat = [c for group in cpus for c in group]
        first = [0]
        for group in cpus:
            first.append(first[-1] + len(group))
        tids = (ctypes.c_int32 * len(cpus))()
        status = self.lib.qvl_team_place(len(cpus), (ctypes.c_int32 * max(1, len(flat)))(*flat),
                                         (ctypes.c_int32 * len(first))(*first), tids)
        return list(tids) if status == 0 else None

    def describe(self) -> str:
        """The tier, the build's extra features and how it was built (for `qvl info`)."""
        if self.lib is None:
            return f"{self.tier.name} (native kernels off: {self.reason})"
        extras = [name for bit, name in ((build.VNNI, "VNNI"), (build.BF16, "BF16"), (build.AVX_VNNI, "AVX-VNNI"),
                                         (build.DOTPROD, "dot products"), (build.I8MM, "int8 matrix products"),
                                         (build.AMX_INT8, "AMX-INT8")) if self.has(bit)]
        threads = "" if self.has(build.OPENMP) else " (no OpenMP: one thread)"
        return (self.tier.name + (f" (+{', +'.join(extras)})" if extras else "")
                + f"; built with {build.compiler()} {' '.join(self.tier.flags)}{threads}")

    @functools.cached_property
    def int8_levels(self) -> int:
        """The activation codes 0..levels whose products oneDNN's int8 GEMM sums exactly against
        any int8 weights: 255 where it multiplies with VNNI or AMX; 127 where it multiplies with
        vpmaddubsw (plain AVX2, AVX-512 without VNNI), whose 16-bit pair sums saturate on 8-bit
        codes but not on 7-bit ones; 0 when neither holds or the op is missing. Probed once, on
        this process's oneDNN, with the worst-case rows and columns."""
        return next((levels for levels in (255, 127) if _int8_gemm_is_exact(levels)), 0)


def _int8_gemm_is_exact(levels: int) -> bool:
    """int8_gemm on codes 0..levels (with all-levels and all-0 rows) and int8 weights (with
    all-127 and all-(-127) rows) equals the exact integer product."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, levels + 1, (32, 64), dtype=torch.uint8, generator=g)
    codes[0], codes[1] = levels, 0
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)
    w[0], w[1] = 127, -127
    try:
        got = int8_gemm(codes, pack_int8(w), 32)
    except (RuntimeError, AttributeError):  # no oneDNN int8 GEMM in this torch build
        return False
    return torch.equal(got.double(), codes.double() @ w.double().t())


def _load() -> Library:
    tier = build.select_tier()
    if os.environ.get("QVL_NATIVE", "1") == "0":
        return Library(tier, None, "QVL_NATIVE=0")
    try:
        return Library(tier, build.load(tier, paths.cache_root() / "native"))
    except (RuntimeError, OSError) as exc:
        print(f"qvl: native kernels unavailable, using torch's ({exc})", file=sys.stderr)
        return Library(tier, None, str(exc).splitlines()[0])


_chosen: list[Library] = []  # the one choice of this process, made on first use


def library() -> Library:
    """The library for this process: chosen and built (or loaded from the cache) on first use."""
    if not _chosen:
        _chosen.append(_load())
    return _chosen[0]
