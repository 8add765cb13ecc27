"""Threads on a machine other programs share (docs/decisions/threads.md).

qvl's kernels keep the engine's thread count: they hand work out in turn and take over the
work of a thread that has stopped (csrc/team.h), so a core shared with another program costs
only the time that program takes. torch's own ops split their work into equal shares and wait
for the slowest, so they run on the cores other programs leave free: the engine measures, as it
runs, how many cores other processes keep busy (their CPU time on this process's CPUs in
/proc/stat, less this process's own, plus the time a hypervisor takes; processes at a lower
priority, `nice`, do not count: they give way) and lowers torch's count by one for each.
A prompt's kernels (the vision tower and prefill: compute-bound, their work handed out in turn)
run on one thread more for each such core: a shared core gives each thread on it an equal turn,
so the extra thread wins the prompt part of the shared core's time instead of a third of it."""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

MEASURE_S = 1.0  # the window over which other programs' load is measured
SAMPLE_S = 0.25  # how often it is read
BUSY_SLACK = 0.3  # a core other programs keep busy less than this much of the time still counts as free

_kernels: ContextVar[int | None] = ContextVar("qvl_kernel_threads", default=None)


def kernel_threads() -> int:
    """The threads qvl's kernels run on: the engine's count inside a step (Threads.step, where
    torch's own may be lower), else torch's."""
    return _kernels.get() or torch.get_num_threads()


@dataclass(frozen=True)
class CpuTimes:
    """One reading: seconds since some start, and CPU seconds on this process's CPUs that other
    processes (at normal priority or above) and the hypervisor took."""

    wall: float
    others: float


def read_cpu_times(stat: Path = Path("/proc/stat"), cpus: list[int] | None = None) -> CpuTimes | None:
    """Other processes' CPU time on `cpus` (default: the ones this process may run on): user,
    system, irq and softirq time of those CPUs, less this process's own, plus steal time (the
    `nice` column, processes that give way, is left out; this process's user time too when it
    runs niced itself). None where /proc/stat cannot be read (not Linux)."""
    allowed = set(cpus if cpus is not None else os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else [])
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (allowed and int(name[3:]) not in allowed):
            continue
        user, _nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        busy += user + system + irq + softirq + steal
    own = os.times()
    niced = hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0
    ours = own.system + (0.0 if niced else own.user)
    return CpuTimes(time.monotonic(), max(0.0, busy / os.sysconf("SC_CLK_TCK") - ours))


def busy_over(read: Callable[[], CpuTimes | None], seconds: float) -> float | None:
    """Cores other programs keep busy, measured over `seconds` (None where it cannot be: not Linux)."""
    first = read()
    time.sleep(seconds)
    last = read()
    return None if first is None or last is None else max(0.0, (last.others - first.others) / (last.wall - first.wall))


def torch_threads(threads: int, busy: float) -> int:
    """torch's threads beside other programs keeping `busy` cores busy: one fewer for each core
    they take (from BUSY_SLACK of one on), at least one."""
    return max(1, min(threads, threads - math.ceil(busy - BUSY_SLACK)))


def prompt_threads(threads: int, busy: float) -> int:
    """The prompt kernels' threads beside other programs keeping `busy` cores busy: one more for
    each core they take (from BUSY_SLACK of one on)."""
    return threads + max(0, math.ceil(busy - BUSY_SLACK))


class Load:
    """Cores other programs keep busy on this process's CPUs over the last MEASURE_S, from
    readings taken every SAMPLE_S by a daemon thread (`watch`), so that the engine's next step
    knows at once when another program starts or stops."""

    def __init__(self, read: Callable[[], CpuTimes | None] = read_cpu_times):
        self.read = read
        first = read()
        self.readings = deque([first] if first is not None else [])
        self.busy = 0.0

    def sample(self) -> None:
        """One reading; `busy` over the readings of the last MEASURE_S (at least two)."""
        now = self.read()
        if now is None or not self.readings:
            return
        self.readings.append(now)
        while len(self.readings) > 2 and now.wall - self.readings[1].wall >= MEASURE_S:
            self.readings.popleft()
        first = self.readings[0]
        if now.wall > first.wall:
            self.busy = max(0.0, (now.others - first.others) / (now.wall - first.wall))

    def watch(self) -> Load:
        """Sample every SAMPLE_S from a daemon thread (where /proc/stat can be read)."""
        def run() -> None:
            while True:
                time.sleep(SAMPLE_S)
                self.sample()

        if self.readings:
            threading.Thread(target=run, name="qvl-cpu-load", daemon=True).start()
        return self


@functools.cache
def machine_load() -> Load:
    """This process's one watch over other programs' load (started on first use)."""
    return Load().watch()


@contextmanager
def _kernels_on(count: int) -> Iterator[None]:
    """Within it, kernel_threads() is `count`."""
    token = _kernels.set(count)
    try:
        yield
    finally:
        _kernels.reset(token)


class Threads:
    """An engine's threads: `kernels` for qvl's kernels, and torch's own ops on as many, or on
    the cores other programs leave free when `load` is watched; a prompt's kernels on `kernels`,
    or one more for each core other programs keep busy (`--threads` fixes all three)."""

    def __init__(self, kernels: int, load: Load | None):
        self.kernels, self.load = kernels, load
        self.torch = self.prompt_kernels = kernels

    def measure(self) -> None:
        """torch's and the prompt kernels' thread counts from the last measured load (torch's set
        in torch when it changes)."""
        if self.load is None:
            return
        self.prompt_kernels = prompt_threads(self.kernels, self.load.busy)
        count = torch_threads(self.kernels, self.load.busy)
        if count != self.torch:
            self.torch = count
            torch.set_num_threads(count)

    def step(self) -> AbstractContextManager[None]:
        """One scheduler step: torch's threads measured; qvl's kernels on all of theirs meanwhile."""
        self.measure()
        return _kernels_on(self.kernels)

    def prompt(self) -> AbstractContextManager[None]:
        """Inside a step: the vision tower's and prefill's kernels on prompt_kernels threads."""
        return _kernels_on(self.prompt_kernels)

    def stats(self) -> dict[str, float]:
        """What /metrics shows."""
        busy = self.load.busy if self.load is not None else 0.0
        return {"qvl_threads_kernels": self.kernels, "qvl_threads_prompt": self.prompt_kernels,
                "qvl_threads_torch": self.torch,
                "qvl_cpu_cores_busy_elsewhere": round(busy, 3)}
