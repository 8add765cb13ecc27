"""A decode step of B rows against one row, for this checkout's kernels and another checkout's,
alternating in one process: what the scheduler's batching gains from a kernel change.

    git worktree add /work/wt-before <commit>
    python benchmarks/decode_rows.py --model /work/ckpt/qvl-2b --before /work/wt-before --rows 1,4,8 --rounds 6
    # rows at different lengths (the list repeated over the rows): long chats beside short ones
    python benchmarks/decode_rows.py ... --rows 8 --positions 1200,1200,1200,1200,40,40,40,40

The other checkout's native library is built for the same tier (QVL_ISA and torch's switches
emulate a lower one, as everywhere) and swapped in between rounds, so both sides run the same
model, weights and cache in the same process. One token per row over 300 cached positions
(or --positions);
medians of the steps of each round. Per round, B rows' step over one row's (the batching cost)
and this checkout's step over the other's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time

import torch

from qvl.kernels import build
from qvl.kernels import library as library_module
from qvl.kernels.library import library
from qvl.engine import Engine, EngineOptions
from qvl.generate import decode_step, new_cache


def library_of(checkout: str, tier: str) -> str:
    """Build (or find in the cache) `checkout`'s native library for `tier`; its path."""
    code = ("from qvl import paths\n"
            "try:\n    from qvl.kernels import build\n"
            "except ImportError:  # a checkout from before qvl.kernels\n    from qvl import native as build\n"
            f"tier = {{t.name: t for t in build.tiers()}}[{tier!r}]\n"
            "print(build.build(paths.cache_root() / 'native', tier))")
    env = dict(os.environ, PYTHONPATH=os.path.join(checkout, "src"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def step_ms(model, cache, rows: int, steps: int, positions: list[int]) -> float:
    tokens = torch.full((rows,), 100)
    slots = torch.tensor([positions[i % len(positions)] for i in range(rows)])
    times = []
    for i in range(steps + 2):
        started = time.perf_counter()
        decode_step(model, cache, tokens, slots, slots)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--before", required=True, help="another checkout (its root) whose kernels to compare")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--weights", default="int8")
    p.add_argument("--positions", default="300", help="each row's cached positions, the list repeated over the rows")
    args = p.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, weights=args.weights, threads=2))
    chosen = library()
    sides = {"before": dataclasses.replace(chosen, lib=build.open_library(library_of(args.before, chosen.tier.name))),
             "after": chosen}
    rows = [int(r) for r in args.rows.split(",")]
    positions = [int(x) for x in args.positions.split(",")]
    caches = {b: new_cache(engine.model, b, max(positions) + 64) for b in rows}
    ms: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for side in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            library_module._chosen[0] = sides[side]
            for b in rows:
                ms.setdefault((side, b), []).append(step_ms(engine.model, caches[b], b, args.steps, positions))
    library_module._chosen[0] = chosen
    print(f"tier {chosen.tier.name}, {args.weights}, 2 threads, {args.rounds} alternating rounds, rows at "
          f"positions {args.positions}; decode step ms, median (min-max)\n")
    print("| side | " + " | ".join(f"{b} rows" for b in rows) + " | " +
          " | ".join(f"{b} rows / 1 row, per round" for b in rows if b != 1) + " |")
    print("|---|" + "---|" * (2 * len(rows) - 1))
    for side in sides:
        cells = [f"{statistics.median(ms[(side, b)]):.1f} ({min(ms[(side, b)]):.1f}-{max(ms[(side, b)]):.1f})"
                 for b in rows]
        cells += [", ".join(f"{x / o:.2f}" for x, o in zip(ms[(side, b)], ms[(side, 1)])) for b in rows if b != 1]
        print(f"| {side} | " + " | ".join(cells) + " |")
    print()
    for b in rows:
        ratios = [a / x for a, x in zip(ms[("after", b)], ms[("before", b)])]
        print(f"{b} rows, after / before per round: {', '.join(f'{v:.2f}' for v in ratios)} "
              f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
