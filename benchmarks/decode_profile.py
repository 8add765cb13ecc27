"""Where a decode step's time goes: the median step (one token per row over 300 cached positions),
the part inside the one-call layer kernel (qvl.kernels.decode_step.decode_layers: every decoder layer's
GEMVs, norms, RoPE and attention), the part inside the lm_head's GEMV, and the rest
(embedding, RoPE tables, final norm, Python).

    python benchmarks/decode_profile.py --model /work/ckpt/qvl-2b --weights int4
    python benchmarks/decode_profile.py --model /work/ckpt/qvl-2b --rows 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qvl.engine import Engine, EngineOptions
from qvl.kernels import decode_step as one_call
from qvl.kernels import linear
from qvl.generate import decode_step, new_cache


def timed(fn, total: list[float]):
    def wrapper(*a, **k):
        started = time.perf_counter()
        out = fn(*a, **k)
        total[0] += time.perf_counter() - started
        return out

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default="int8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=1, help="rows decoded together (requests in one step)")
    args = p.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, weights=args.weights, threads=2))
    model, layers, head = engine.model, [0.0], [0.0]
    one_call.decode_layers = timed(one_call.decode_layers, layers)  # qvl.kernels' ops and products call them
    linear.gemv = timed(linear.gemv, head)  # through the module: the lm_head is the only GEMV left
    rows = args.rows
    cache, token, slot = new_cache(model, rows, 512), torch.full((rows,), 100), torch.full((rows,), 300)
    steps = []
    for i in range(args.steps + 3):
        if i == 3:
            layers[0] = head[0] = 0.0
        started = time.perf_counter()
        decode_step(model, cache, token, slot, slot)  # at slot 300 (earlier slots: whatever they hold)
        if i >= 3:
            steps.append(time.perf_counter() - started)
    step, in_layers, in_head = statistics.median(steps), layers[0] / args.steps, head[0] / args.steps
    print(f"{engine.weights}, {rows} row{'s' if rows > 1 else ''}: step median {step * 1e3:.1f} ms; "
          f"layers (one native call) {in_layers * 1e3:.1f} ms, lm_head {in_head * 1e3:.1f} ms, "
          f"rest {(step - in_layers - in_head) * 1e3:.1f} ms (means per step)")


if __name__ == "__main__":
    main()
