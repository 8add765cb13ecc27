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
so the extra thread wins the prompt part of the shared core's time instead of a third of it.
Meanwhile the threads are placed (`Placement`): each on a core of its own, the engine's thread on
a core no other program uses, the prompt's extra threads on the shared cores."""

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

from qvl.runtime import core_cpus

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


def read_cpu_busy(stat: Path = Path("/proc/stat"), cpus: list[int] | None = None) -> dict[int, int] | None:
    """Each of `cpus`' (default: the ones this process may run on) busy clock ticks since boot:
    user, system, irq, softirq and steal time (`nice`, processes that give way, left out). None
    where /proc/stat cannot be read (not Linux)."""
    allowed = set(cpus if cpus is not None else os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else [])
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = {}
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (allowed and int(name[3:]) not in allowed):
            continue
        user, _nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        busy[int(name[3:])] = user + system + irq + softirq + steal
    return busy


def read_cpu_times(stat: Path = Path("/proc/stat"), cpus: list[int] | None = None) -> CpuTimes | None:
    """Other processes' CPU time on `cpus` (default: the ones this process may run on): their busy
    time (read_cpu_busy) less this process's own (its user time too when it runs niced itself).
    None where /proc/stat cannot be read (not Linux)."""
    busy = read_cpu_busy(stat, cpus)
    if busy is None:
        return None
    own = os.times()
    niced = hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0
    ours = own.system + (0.0 if niced else own.user)
    return CpuTimes(time.monotonic(), max(0.0, sum(busy.values()) / os.sysconf("SC_CLK_TCK") - ours))


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


def thread_stat(tid: int) -> tuple[int, int] | None:
    """Thread `tid` of this process: its user + system clock ticks and the CPU it last ran on;
    None once it has ended (or not Linux)."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12]), int(fields[36])  # utime, stime; processor


def placement(cores: list[tuple[int, ...]], threads: int, shared: set[int]) -> list[tuple[int, ...]]:
    """The CPUs of each of `threads` pool threads, `shared` the indices of the cores other programs
    keep busy: thread t on a core of its own, the cores nothing else uses first (thread 0, the
    engine's, which also runs the step's Python and torch's ops on one thread, on one of those);
    threads beyond the cores on the shared cores (on every core when none is shared)."""
    busy = [c for i, c in enumerate(cores) if i in shared]
    order = [c for i, c in enumerate(cores) if i not in shared] + busy
    extra = busy or cores
    return [order[t] if t < len(order) else extra[(t - len(order)) % len(extra)] for t in range(threads)]


class Placement:
    """Where the engine's threads run while other programs keep a core busy (docs/decisions/threads.md).

    Left to itself, the OS may put two of the engine's threads on one core and the other program
    alone on the other: the engine then has one core, not one and a half. While `busy` (and
    torch's ops on one thread: `update`), each of the kernels' pool threads is pinned (`place`:
    thread t -> CPUs) as `placement` says, and every MEASURE_S the cores' other load is measured
    (/proc/stat per CPU less the pinned threads' own time): when the engine's thread turns out to
    share its core, the threads move. Once quiet, every pinned thread may run anywhere again.
    Threads the engine's thread starts while pinned inherit its core: among them a prompt's extra
    thread once a decoding region of fewer threads has ended it (libgomp starts it again)."""

    def __init__(self, cores: list[tuple[int, ...]], place: Callable[[list[tuple[int, ...]]], list[int] | None],
                 read: Callable[[list[int]], dict[int, int] | None] = lambda cpus: read_cpu_busy(cpus=cpus)):
        self.cores, self.place, self.read = cores, place, read
        self.cpus = tuple(c for core in cores for c in core)
        self.pinned: list[tuple[int, ...]] | None = None  # each pool thread's CPUs; None: anywhere
        self.tids: list[int] = []
        self.shared: set[int] = set()
        self.since: tuple[float, dict[int, int], list[int]] | None = None  # the last measure's readings
        self.failed = len(cores) < 2

    def update(self, busy: float, threads: int, torch_count: int) -> None:
        """On the engine's thread, before a step: `busy` cores other programs keep busy, `threads`
        the most the step's kernels run on, `torch_count` torch's. Pinned only while torch's ops run
        on one thread:
        libgomp ends the pool threads a smaller region leaves out and starts them again for the
        next larger one, with the engine thread's CPUs, so torch's regions of 2 or more threads
        (more than one free core) would leave the restarted threads on the engine's core."""
        if self.failed:
            return
        if busy < BUSY_SLACK or torch_count != 1:
            if self.pinned is not None:
                self.release()
            return
        if self.pinned is None:
            main = thread_stat(threading.get_native_id())
            here = next((i for i, c in enumerate(self.cores) if main and main[1] in c), 0)
            self.shared = {i for i in range(len(self.cores)) if i != here}  # until measured: stay where it is
            self._pin(threads)
        elif len(self.pinned) != threads:
            self._pin(threads)
        elif self.since is not None and time.monotonic() - self.since[0] >= MEASURE_S:
            others = self._measure()
            main = self.cores.index(self.pinned[0])
            if others is not None and others[main] >= BUSY_SLACK and min(others) < BUSY_SLACK / 2:
                # the engine's thread shares its core and another core is clearly free (a program
                # the OS moves between the cores, busy on each part of the time, is no reason)
                self.shared = {i for i, o in enumerate(others) if o >= BUSY_SLACK / 2}
                self._pin(threads)

    def _pin(self, threads: int) -> None:
        wanted = placement(self.cores, threads, self.shared)
        tids = self.place(wanted)
        if tids is None:  # threads cannot be placed here: never try again
            self.failed = True
            self.pinned = None
            return
        self.pinned, self.tids = wanted, tids
        self.since = self._readings()

    def _readings(self) -> tuple[float, dict[int, int], list[int]] | None:
        cpus = self.read(list(self.cpus))  # (not this thread's CPUs: it is pinned)
        ticks = [stat[0] if (stat := thread_stat(tid)) else None for tid in self.tids]
        return None if cpus is None else (time.monotonic(), cpus, ticks)

    def _measure(self) -> list[float] | None:
        """Each core's share of the time since the last readings that other programs took."""
        now, before = self._readings(), self.since
        self.since = now
        if now is None or before is None:
            return None
        ticks = (now[0] - before[0]) * os.sysconf("SC_CLK_TCK")
        others = [float(sum(now[1].get(c, 0) - before[1].get(c, 0) for c in core)) for core in self.cores]
        for group, t1, t0 in zip(self.pinned, now[2], before[2]):
            if t1 is not None and t0 is not None:  # (a thread that ended is not counted)
                others[self.cores.index(group)] -= t1 - t0
        return [max(0.0, o / ticks) for o in others]

    def release(self) -> None:
        """Every pool thread back on all the cores."""
        for tid in self.tids:
            try:
                os.sched_setaffinity(tid, self.cpus)
            except OSError:  # the thread has ended
                pass
        self.pinned, self.tids, self.since = None, [], None


@contextmanager
def _kernels_on(count: int) -> Iterator[None]:
    """Within it, kernel_threads() is `count`."""
    token = _kernels.set(count)
    try:
        yield
    finally:
        _kernels.reset(token)


def team_placement(threads: int) -> Placement | None:
    """The placement of the calling thread's kernel pool, where its `threads` threads are one per
    core this process may use (the default count; None otherwise, and on one core)."""
    from qvl.kernels.library import library

    cores = core_cpus()
    return Placement(cores, library().place_team) if len(cores) == threads >= 2 else None


class Threads:
    """An engine's threads: `kernels` for qvl's kernels, and torch's own ops on as many, or on
    the cores other programs leave free when `load` is watched; a prompt's kernels on `kernels`,
    or one more for each core other programs keep busy (`--threads` fixes all three)."""

    def __init__(self, kernels: int, load: Load | None, placement: Placement | None = None):
        self.kernels, self.load, self.placement = kernels, load, placement
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
        if self.placement is not None:
            self.placement.update(self.load.busy, max(self.kernels, self.prompt_kernels), count)

    def step(self) -> AbstractContextManager[None]:
        """One scheduler step: torch's threads measured; qvl's kernels on all of theirs meanwhile."""
        self.measure()
        return _kernels_on(self.kernels)

    def rest(self) -> None:
        """Nothing left to run: every pinned pool thread may run anywhere again, the caller's
        thread among them (it drives the scheduler, and goes on to a program's other work)."""
        if self.placement is not None and self.placement.pinned is not None:
            self.placement.release()

    def prompt(self) -> AbstractContextManager[None]:
        """Inside a step: the vision tower's and prefill's kernels on prompt_kernels threads."""
        return _kernels_on(self.prompt_kernels)

    def stats(self) -> dict[str, float]:
        """What /metrics shows."""
        busy = self.load.busy if self.load is not None else 0.0
        placed = self.placement is not None and self.placement.pinned is not None
        return {"qvl_threads_kernels": self.kernels, "qvl_threads_prompt": self.prompt_kernels,
                "qvl_threads_torch": self.torch, "qvl_threads_pinned": int(placed),
                "qvl_cpu_cores_busy_elsewhere": round(busy, 3)}
