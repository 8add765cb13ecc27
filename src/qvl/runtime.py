"""CPU runtime choices made from the machine: features, dtype, threads, pinning."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo's `flags` (x86) or `Features` (ARM) line for the
    first CPU; on macOS, the hw.optional sysctl names that are set. Empty where none is found."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "hw.optional"], capture_output=True, text=True, timeout=5).stdout
            return frozenset(line.split(":")[0].rsplit(".", 1)[-1] for line in out.splitlines()
                             if line.rstrip().endswith(": 1"))
        except (OSError, subprocess.SubprocessError):
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


def choose_dtype(name: str = "auto", native_bf16: bool | None = None) -> torch.dtype:
    """'auto' = bf16 where the CPU computes it natively (AVX512-BF16 or AMX, on the kernel
    tier in use: see qvl.kernels.build.select_tier), else fp32 (bf16 emulated on older CPUs is
    20-30x slower)."""
    if name == "auto":
        if native_bf16 is None:
            from qvl.kernels.build import select_tier

            native_bf16 = select_tier().bf16
        return torch.bfloat16 if native_bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose auto, bf16 or fp32)")
    return DTYPES[name]


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def core_cpus(sysfs: Path = Path("/sys/devices/system/cpu")) -> list[tuple[int, ...]]:
    """The CPUs this process may run on, grouped by physical core (a core's hardware threads
    together), in CPU order; [] where the topology cannot be read (not Linux)."""
    cores: dict[str, list[int]] = {}
    for cpu in allowed_cpus():
        try:
            siblings = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            return []
        cores.setdefault(siblings, []).append(cpu)
    return sorted(tuple(cpus) for cpus in cores.values())


def physical_cores(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores this process may run on (a core's second hardware thread does not speed
    up matmuls): on Linux the distinct cores among the allowed CPUs (each CPU's thread
    siblings), elsewhere the allowed CPUs scaled by cores / logical CPUs. A hybrid CPU (P-cores
    with two threads, E-cores with one: 20 logical CPUs on 14 cores) counts 14, not 20."""
    if cores := core_cpus(sysfs):
        return len(cores)
    import psutil

    allowed = allowed_cpus()
    physical = psutil.cpu_count(logical=False) or len(allowed)
    logical = psutil.cpu_count(logical=True) or len(allowed)
    return max(1, round(len(allowed) * physical / logical))


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


def pin(cpus: list[int]) -> None:
    """Run this process (and the threads it starts later) on these CPUs; no root needed."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError(f"pinning to CPUs is not supported on {sys.platform}; use threads instead")
    os.sched_setaffinity(0, cpus)


@dataclass(frozen=True)
class RuntimeInfo:
    dtype: torch.dtype
    threads: int
    cpus: tuple[int, ...]


def configure(dtype: str = "auto", threads: int | None = None, cpus: list[int] | None = None) -> RuntimeInfo:
    """Pin the process (no root needed) and set torch's thread count."""
    if cpus:
        pin(cpus)
    n = threads or (len(cpus) if cpus else physical_cores())
    if n < 1:
        raise ValueError("threads must be >= 1")
    torch.set_num_threads(n)
    return RuntimeInfo(dtype=choose_dtype(dtype), threads=n, cpus=tuple(allowed_cpus()))


def huge_pages(sysfs: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> str:
    """Whether torch's tensors of 2 MB or more sit on transparent huge pages (qvl/__init__.py
    asks torch for them), and why not where they do not."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") in ("0", ""):
        return "off (THP_MEM_ALLOC_ENABLE=0)"
    try:
        mode = sysfs.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "off (no transparent huge pages on this system)"
    return f"off (the kernel's transparent huge pages: {mode})" if mode == "never" else f"tensors of 2 MB or more ({mode})"
