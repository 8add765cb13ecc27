"""Many-row int8 x int8 products on AMX: qvl's int8-tile kernel (each 32 x 32 block of sums
rescaled while in L1, `qvl.kernels.linear.int8_matmul(..., amx=True)`) against oneDNN's int8 GEMM and the
separate rescale pass (what ran before, and what CPUs without AMX run), on the vision towers'
shapes at the default budget (1008 patches), the norm, GELU and residual fused as the tower
fuses them. The two sides alternate in every round; both include the quantise pass.

    python benchmarks/int8_tiles.py --rounds 7

Prints per shape the median ms (min-max) of each side and the tiles / oneDNN ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from compare import median_time

from qvl.kernels import build, linear
from qvl.kernels.library import library

SHAPES = {  # name: (in, out, gelu, residual, layer norm) as the vision blocks call them
    "2B qkv (1024 -> 3072)": (1024, 3072, False, False, True),
    "2B fc1 (1024 -> 4096)": (1024, 4096, True, False, True),
    "2B fc2 (4096 -> 1024)": (4096, 1024, False, True, False),
    "8B qkv (1152 -> 3456)": (1152, 3456, False, False, True),
    "8B proj (1152 -> 1152)": (1152, 1152, False, True, False),
    "8B fc1 (1152 -> 4304)": (1152, 4304, True, False, True),
    "8B fc2 (4304 -> 1152)": (4304, 1152, False, True, False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1008)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = library()
    if not k.has(build.AMX_INT8):
        raise SystemExit("this CPU (or build) has no AMX int8 tiles")
    print(f"{args.rows} rows, {args.threads} threads, {args.rounds} alternating rounds, medians (min-max) in ms\n")
    print("| product | oneDNN + rescale pass | int8 tiles | tiles / oneDNN |")
    print("|---|---|---|---|")
    totals = {"onednn": 0.0, "tiles": 0.0}
    for name, (k_in, n, gelu, residual, norm) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(args.rows, k_in).bfloat16()
        w = torch.randint(-127, 128, (n, k_in), dtype=torch.int8)
        scale, bias = (torch.rand(n) / 50).bfloat16(), torch.randn(n).bfloat16()
        colsums = w.sum(1, dtype=torch.int32).float()
        res = torch.randn(args.rows, n).bfloat16() if residual else None
        ln = ((torch.rand(k_in) + 0.5).bfloat16(), torch.randn(k_in).bfloat16(), 1e-6) if norm else None
        packs = {"onednn": (linear.pack_int8(w), False), "tiles": (linear.amx_pack_int8(k.lib, w), True)}
        times: dict[str, list[float]] = {side: [] for side in packs}
        for r in range(args.rounds):
            for side in (list(packs) if r % 2 == 0 else list(packs)[::-1]):
                packed, amx = packs[side]
                times[side].append(median_time(lambda: linear.int8_matmul(k.lib, x, packed, colsums, scale, bias,
                                                                          255, gelu, res, ln, amx), repeat=5))
        med = {side: statistics.median(t) for side, t in times.items()}
        for side in med:
            totals[side] += med[side]
        cells = [f"{med[s] * 1e3:.2f} ({min(times[s]) * 1e3:.2f}-{max(times[s]) * 1e3:.2f})" for s in packs]
        print(f"| {name} | {cells[0]} | {cells[1]} | {med['tiles'] / med['onednn']:.2f} |")
    print(f"| all of the above | {totals['onednn'] * 1e3:.2f} | {totals['tiles'] * 1e3:.2f} | "
          f"{totals['tiles'] / totals['onednn']:.2f} |")


if __name__ == "__main__":
    main()
