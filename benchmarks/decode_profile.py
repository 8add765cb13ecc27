"""Where a decode step's time goes: the median step (one token over 300 cached positions)
and the part of it spent inside qvl's GEMV kernels; the rest is norms, RoPE, attention,
residuals and Python.

    python benchmarks/decode_profile.py --model /work/ckpt/qvl-2b --weights int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qvl import native
from qvl.engine import Engine, EngineOptions
from qvl.generate import decode_step, new_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default="int8")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, weights=args.weights, threads=2))
    model, inside = engine.model, [0.0]
    linear = native.linear

    def timed(*a, **k):
        started = time.perf_counter()
        out = linear(*a, **k)
        inside[0] += time.perf_counter() - started
        return out

    native.linear = timed  # quantize.py calls it through the module
    cache, token, position = new_cache(model, 1, 512), torch.tensor([100]), torch.tensor([300])
    steps = []
    for i in range(args.steps + 3):
        cache.length = 300
        if i == 3:
            inside[0] = 0.0
        started = time.perf_counter()
        decode_step(model, cache, token, position)
        if i >= 3:
            steps.append(time.perf_counter() - started)
    gemv = inside[0] / args.steps
    print(f"{engine.weights}: step median {statistics.median(steps) * 1e3:.1f} ms, "
          f"GEMV kernels {gemv * 1e3:.1f} ms per step (mean)")


if __name__ == "__main__":
    main()
