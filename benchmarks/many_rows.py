"""Many-row products (vision, prefill) of int8 weights on each kernel tier, emulated as in
benchmarks/tiers.py (torch's ATEN, oneDNN and MKL switches held to the tier), one process per
tier, the ways of computing them alternating within each round:

  float32 GEMM       F.linear on a float weight (what transformers runs; MKL's sgemm)
  dequantise whole   the int8 weight dequantised at once, then the float GEMM (qvl before)
  dequantise blocks  1024 weight rows at a time (qvl's float path up to 512 rows: prefill chunks)
  int8 x int8        activations quantised per row, oneDNN's int8 GEMM (qvl.kernels.linear.int8_matmul:
                     the vision tower's default on x86 without AMX, --int8-activations all)

Shapes: the 2B vision tower at the default budget (1008 patches) and the 2B decoder over a
268-token prompt (the photo prompt of tiers.py). Prints medians (min-max) in ms and the ratios.

    python benchmarks/many_rows.py --tiers avx512-nobf16,avx2-vnni,avx2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from tiers import tier_env  # benchmarks/tiers.py (this script's folder is on sys.path)

SHAPES = {  # name: (rows, in, out)
    "vision qkv": (1008, 1024, 3072), "vision fc1": (1008, 1024, 4096), "vision fc2": (1008, 4096, 1024),
    "prefill q": (268, 2048, 2048), "prefill gate/up": (268, 2048, 6144), "prefill down": (268, 6144, 2048),
}
WAYS = ("float32 GEMM", "dequantise whole", "dequantise blocks", "int8 x int8")


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    from qvl.kernels import linear, products
    from qvl.quantize import quantize_int8
    from qvl.kernels.library import library

    torch.set_num_threads(args.threads)
    lib = library().lib
    products.DEQUANTIZED_MAX_ACTIVATIONS = 1 << 30  # blocks at every row count, to compare

    def blocks(x, q, s):
        return products.dequantized_product(x, q.shape[0], lambda r: products.dequantize_int8(q[r], s[r]))

    times: dict[str, dict[str, list[float]]] = {}
    for name, (m, k, n) in SHAPES.items():
        x, w = torch.randn(m, k), torch.randn(n, k)
        q, s = quantize_int8(w)
        dense = q.float() * s[:, None]
        ways = {
            "float32 GEMM": lambda: F.linear(x, dense),
            "dequantise whole": lambda: F.linear(x, products.dequantize_int8(q, s)),
            "dequantise blocks": lambda: blocks(x, q, s),
            "int8 x int8": lambda: linear.int8_matmul(lib, x, q, s),
        }
        for fn in ways.values():
            fn()  # warm-up
        times[name] = {way: [] for way in ways}
        for rnd in range(args.rounds):
            for way in (WAYS if rnd % 2 == 0 else WAYS[::-1]):
                started = time.perf_counter()
                ways[way]()
                times[name][way].append((time.perf_counter() - started) * 1e3)
    print(json.dumps({"tier": library().tier.name, "times": times}))


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiers", default="avx512-nobf16,avx2-vnni,avx2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    print(f"{args.threads} threads, {args.rounds} alternating rounds; ms, medians (min-max)\n")
    print("| tier | product (rows x in x out) | " + " | ".join(WAYS) +
          " | blocks vs whole | int8 x int8 vs float32 GEMM |")
    print("|---|---|" + "---|" * (len(WAYS) + 2))
    for tier in args.tiers.split(","):
        cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=tier_env(tier), timeout=3600)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        result = json.loads(done.stdout.strip().splitlines()[-1])
        for name, ways in result["times"].items():
            med = {w: statistics.median(v) for w, v in ways.items()}
            shape = "x".join(map(str, SHAPES[name]))
            print(f"| {result['tier']} | {name} ({shape}) | " + " | ".join(spread(ways[w]) for w in WAYS) +
                  f" | {med['dequantise whole'] / med['dequantise blocks']:.2f}× |"
                  f" {med['float32 GEMM'] / med['int8 x int8']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
