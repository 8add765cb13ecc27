"""CPU runtime choices made from the machine: features, dtype, threads, pinning."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo lists for the first CPU (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matmuls run natively (fp32 is several times slower)."""
    flags = cpu_flags() if flags is None else flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def choose_dtype(name: str = "auto", flags: frozenset[str] | None = None) -> torch.dtype:
    """'auto' = bf16 where the CPU computes it natively, else fp32 (bf16 emulated on
    older CPUs is 20-30x slower)."""
    if name == "auto":
        return torch.bfloat16 if has_native_bf16(flags) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose auto, bf16 or fp32)")
    return DTYPES[name]


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads do not speed up matmuls)."""
    import psutil

    allowed = len(allowed_cpus())
    physical = psutil.cpu_count(logical=False) or allowed
    logical = psutil.cpu_count(logical=True) or allowed
    per_core = max(1, logical // physical)
    return max(1, allowed // per_core)


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    if not cpus:
        raise ValueError(f"empty CPU list '{text}'")
    return cpus


@dataclass(frozen=True)
class RuntimeInfo:
    dtype: torch.dtype
    threads: int
    cpus: tuple[int, ...]


def configure(dtype: str = "auto", threads: int | None = None, cpus: list[int] | None = None) -> RuntimeInfo:
    """Pin the process (no root needed) and set torch's thread count."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    n = threads or (len(cpus) if cpus else physical_cores())
    if n < 1:
        raise ValueError("threads must be >= 1")
    torch.set_num_threads(n)
    return RuntimeInfo(dtype=choose_dtype(dtype), threads=n, cpus=tuple(allowed_cpus()))
