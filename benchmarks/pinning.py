"""Decode latency spread with and without CPU pinning while another process keeps one
core busy (`--threads` / `--cpus`, sched_setaffinity, no root needed).

    python benchmarks/pinning.py --model /work/ckpt/qvl-2b --weights int8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def bench(args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "qvl.cli", "bench", "--model", args.model, "--weights", args.weights,
           "--image", "none", "--new-tokens", str(args.new_tokens), "--repeat", str(args.repeat), "--json", *extra]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default="int8")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    busy_cpu, free = cpus[-1], [c for c in cpus if c != cpus[-1]]
    cases = [("idle machine", False, ["--threads", str(len(cpus))])]
    cases += [(f"one core busy, {len(cpus)} threads, not pinned", True, ["--threads", str(len(cpus))]),
              (f"one core busy, {len(free)} thread(s) pinned to the free CPUs {free}", True,
               ["--threads", str(len(free)), "--cpus", ",".join(map(str, free))])]
    print("| case | decode median ms | p90 ms | p90 / median |\n|---|---|---|---|")
    for label, loaded, extra in cases:
        load = subprocess.Popen([sys.executable, "-c", BUSY, str(busy_cpu)]) if loaded else None
        try:
            r = bench(args, extra)
        finally:
            if load:
                load.kill()
                load.wait()
        med, p90 = r["decode_ms_per_token"], r["decode_p90_ms"]
        print(f"| {label} | {med:.1f} | {p90:.1f} | {p90 / med:.2f} |", flush=True)


if __name__ == "__main__":
    main()
