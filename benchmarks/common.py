"""Helpers shared by the benchmark scripts: spreads and ratios, timed calls in alternating rounds,
a streamer stamping transformers' tokens, child processes with their peak memory and a time
limit, a free port, kernel tiers emulated through the environment, the CPU's class, and markdown
tables and sections.

Standard library only: scripts run it under other interpreters too (a peer's own virtualenv).
"""

from __future__ import annotations

import atexit
import base64
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max)' of values; one value alone is printed bare."""
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def ratio(value: float, base: float) -> str:
    """value / base as '1.23x'."""
    return f"{value / base:.2f}x"


def rotations(names: list[str], rounds: int):
    """(round, order) for each round: names in an order rotated by one each round, so no engine
    is always first (or last) after the others."""
    for r in range(rounds):
        k = r % len(names) if names else 0
        yield r, names[k:] + names[:k]


def round_ratio(values: list[float], bases: list[float]) -> float:
    """The median over rounds of each round's value / base (both measured in that round)."""
    return statistics.median(v / b for v, b in zip(values, bases))


def alternate(sides: dict[str, Callable[[], object]], rounds: int, echo: bool = False) -> dict[str, list]:
    """Each side's measurement (what its callable returns) once per round, the sides in an order
    rotated every round (reversed, for two); echo: print each as it comes."""
    results: dict[str, list] = {name: [] for name in sides}
    for r, order in rotations(list(sides), rounds):
        for name in order:
            results[name].append(sides[name]())
            if echo:
                print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    return results


class TokenStamps:
    """A streamer for transformers' generate keeping the time of each new token (generate's
    first put is the prompt)."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def time_call(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median seconds of `repeat` calls of fn, after one call not timed (a warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@dataclass
class Finished:
    """A child process that has exited: its exit code, output, wall time and peak resident memory
    (ru_maxrss of the child itself, from wait4; processes it started are not counted)."""
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_bytes: int
    timed_out: bool = False

    def tail(self, lines: int = 15) -> str:
        """The last lines of its output, for an error message."""
        return "\n".join((self.stdout + self.stderr).strip().splitlines()[-lines:])


class Child:
    """A child process in its own session (a time-out kills all it started), its output in
    temporary files, reaped with wait4 so that its peak resident memory is known. Children still
    running when the script exits (an exception, Ctrl-C, or SIGTERM after stop_on_sigterm) are
    killed with their groups."""

    live: set[Child] = set()

    def __init__(self, cmd: list[str], env: dict | None = None, cwd: str | None = None):
        self.started = time.perf_counter()
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.pid = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._out,
                                    stderr=self._err, text=True, start_new_session=True).pid
        self._status: tuple[int, int] | None = None  # (exit code, ru_maxrss bytes) once reaped
        Child.live.add(self)

    def alive(self) -> bool:
        if self._status is None:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self._status = (os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)  # Linux: KiB
        return self._status is None

    def output(self) -> str:
        """What it has printed so far (stdout and stderr)."""
        return "".join(self._read(f) for f in (self._out, self._err))

    def finish(self, timeout: float, stop: bool = False) -> Finished:
        """Wait up to timeout seconds for it to exit (stop: SIGTERM first), past that kill its
        process group; return its output and peak RSS."""
        if stop and self.alive():
            self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        timed_out = False
        while self.alive():
            if time.monotonic() > deadline and not timed_out:
                timed_out = True
                self._signal(signal.SIGKILL)
            time.sleep(0.02)
        self._signal(signal.SIGKILL)  # anything it left behind in its group
        Child.live.discard(self)
        code, rss = self._status
        return Finished(code, self._read(self._out), self._read(self._err), time.perf_counter() - self.started, rss,
                        timed_out)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _read(f) -> str:
        f.flush()
        f.seek(0)
        return f.read()


@atexit.register
def _kill_live() -> None:
    for child in list(Child.live):
        child._signal(signal.SIGKILL)


def stop_on_sigterm() -> None:
    """Make SIGTERM exit the script the normal way, so that its children are killed too."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: str | None = None) -> Finished:
    """Run cmd to its end (killed after timeout seconds); its output and peak RSS."""
    return Child(cmd, env=env, cwd=cwd).finish(timeout)


def wait_healthy(server: Child, port: int, timeout: float) -> None:
    """Wait until the server's /health on the loopback port answers 200 (RuntimeError when it
    exits first or is not ready after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError("exited while loading")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """data as a base64 data URI (an image in a chat request)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# -- kernel tiers -----------------------------------------------------------------------------

# tier (QVL_ISA) -> torch's switches that hold its own kernels to the same instructions (MKL runs
# torch's float32 GEMMs and ignores oneDNN's switch)
TORCH_ENV = {
    "avx512": {},
    "avx512-noamx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512-nobf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2-vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def tier_env(tier: str) -> dict[str, str]:
    """This process's environment with qvl's kernels (QVL_ISA) and torch's held to `tier`: an
    older CPU emulated on this one."""
    return {**os.environ, "QVL_ISA": tier, **TORCH_ENV.get(tier, {})}


# -- the CPU ----------------------------------------------------------------------------------

# (family, first model, last model) -> microarchitecture; families as /proc/cpuinfo prints them
AMD_CORES = [(23, 0x00, 0x2f, "Zen / Zen+"), (23, 0x30, 0xff, "Zen 2"), (25, 0x00, 0x0f, "Zen 3"),
             (25, 0x10, 0x1f, "Zen 4"), (25, 0x20, 0x5f, "Zen 3"), (25, 0x60, 0xaf, "Zen 4"),
             (26, 0x00, 0xff, "Zen 5")]
INTEL_CORES = {0x3c: "Haswell", 0x3f: "Haswell", 0x45: "Haswell", 0x46: "Haswell", 0x3d: "Broadwell",
               0x47: "Broadwell", 0x4f: "Broadwell", 0x56: "Broadwell", 0x4e: "Skylake", 0x5e: "Skylake",
               0x55: "Skylake-SP / Cascade Lake", 0x8e: "Kaby / Coffee Lake", 0x9e: "Kaby / Coffee Lake",
               0xa5: "Comet Lake", 0x7d: "Ice Lake", 0x7e: "Ice Lake", 0x6a: "Ice Lake-SP", 0x6c: "Ice Lake-SP",
               0x8c: "Tiger Lake", 0x8d: "Tiger Lake", 0x97: "Alder Lake", 0x9a: "Alder Lake",
               0xb7: "Raptor Lake", 0xba: "Raptor Lake", 0xbf: "Raptor Lake", 0xaa: "Meteor Lake",
               0xbd: "Lunar Lake", 0xc5: "Arrow Lake", 0xc6: "Arrow Lake", 0xaf: "Sierra Forest",
               0x8f: "Sapphire Rapids", 0xcf: "Emerald Rapids", 0xad: "Granite Rapids", 0xae: "Granite Rapids"}


def cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    """The first processor's fields of /proc/cpuinfo (flags as a set)."""
    fields = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    fields["flags"] = set(fields.get("flags", "").split())
    return fields


def core_name(info: dict) -> str:
    """'AMD Zen 4', 'Intel Sapphire Rapids', or the vendor with its family and model numbers."""
    vendor = info.get("vendor_id", "")
    family, model = int(info.get("cpu family", 0)), int(info.get("model", 0))
    if vendor == "AuthenticAMD":
        for fam, lo, hi, name in AMD_CORES:
            if fam == family and lo <= model <= hi:
                return f"AMD {name}"
    if vendor == "GenuineIntel" and family == 6 and model in INTEL_CORES:
        return f"Intel {INTEL_CORES[model]}"
    short = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor, vendor or "unknown CPU")
    return f"{short} family {family} model {model:#x}"


def cpu_class(info: dict | None = None) -> str:
    """The CPU's class for a results heading: core and the vector features inference uses, e.g.
    'AMD Zen 4 (AVX-512, VNNI, BF16; no AMX)' or 'Intel Skylake (AVX2; no AVX-512)'."""
    info = info or cpuinfo()
    flags = info["flags"]
    avx512 = "avx512f" in flags
    have = ["AVX-512" if avx512 else "AVX2" if "avx2" in flags else "no AVX2"]
    if "avx512_vnni" in flags:
        have.append("VNNI")
    elif "avx_vnni" in flags:
        have.append("AVX-VNNI")
    if "avx512_bf16" in flags:
        have.append("BF16")
    if "amx_tile" in flags:
        have.append("AMX")
    missing = "" if "amx_tile" in flags else "; no AMX" if avx512 else "; no AVX-512" if "avx2" in flags else ""
    return f"{core_name(info)} ({', '.join(have)}{missing})"


# -- markdown ---------------------------------------------------------------------------------

def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_section(text: str, heading: str, body: str) -> str:
    """text with the section '## heading' (to the next '## ' heading or the end) replaced by
    heading and body; appended at the end when there is none."""
    section = f"## {heading}\n\n{body.strip()}\n"
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip() == f"## {heading}"]
    if not starts:
        return text.rstrip() + ("\n\n" if text.strip() else "") + section
    begin = starts[0]
    end = next((i for i in range(begin + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rest = "".join(lines[end:])
    return "".join(lines[:begin]) + section + ("\n" + rest if rest else "")


def write_section(path: str, heading: str, body: str, header: str) -> None:
    """Replace (or add) the section '## heading' of the markdown file at path, keeping the rest;
    a missing file starts with header."""
    text = open(path).read() if os.path.exists(path) else header.strip() + "\n"
    with open(path, "w") as f:
        f.write(replace_section(text, heading, body))
