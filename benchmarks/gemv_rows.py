"""The int8 GEMV kernel's cost per activation row count, for two kernel builds alternating in
one run: what a decode step of B rows costs against one row (the scheduler's batching gain).

    python benchmarks/gemv_rows.py --tiers avx512,avx512-noamx --rounds 5
    python benchmarks/gemv_rows.py --crossover --rounds 3

On an AMX CPU, `avx512` takes int8 products on AMX tiles and `avx512-noamx` is the same CPU
without them (AVX-512 VNNI, as a Zen 4). The weight is 400 MB of int8 (bigger than what the
VM's caches hold, as a model's layers are), K = 2048; activations bf16.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from compare import median_time  # benchmarks/ is the script's folder, first on sys.path

from qvl import paths
from qvl.kernels import build, linear


def timed(fn, repeat: int) -> float:
    """Median ms of `repeat` calls after a warm-up one."""
    return median_time(fn, repeat) * 1000


def crossover(rounds: int) -> None:
    """The default build's int8 GEMV kernel against dequantising + torch's GEMM (oneDNN, bf16)
    for 16-128 rows, on the 2B decoder's and 30B-A3B's expert shapes: where the kernel's row
    limit (qvl.kernels.plan.AMX_GEMV_MAX_ROWS) belongs."""
    import torch.nn.functional as F

    from qvl.kernels.library import library
    from qvl.kernels.products import scratch

    lib, rows = library().lib, (16, 24, 32, 48, 64, 96, 128)
    print(f"dequantise + GEMM time / GEMV kernel time (above 1: the kernel is faster); {rounds} rounds, medians")
    print("\n| K x N | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k, n in ((2048, 6144), (6144, 2048), (2048, 2048), (2048, 1536), (768, 2048)):
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = (torch.rand(n) / 100).bfloat16()
        ratios = {m: [] for m in rows}
        for r in range(rounds):
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                gemm = lambda: F.linear(x, linear.dequantize(lib, build.W_INT8, w, s, None, 0, (n, k),  # noqa: E731
                                                             scratch((n, k), torch.bfloat16)))
                gemv = lambda: linear.gemv(lib, build.W_INT8, x, w, n, s)  # noqa: E731
                pair = [timed(gemm, 5), timed(gemv, 5)] if r % 2 == 0 else [timed(gemv, 5), timed(gemm, 5)][::-1]
                ratios[m].append(pair[0] / pair[1])
        print(f"| {k} x {n} | " + " | ".join(f"{statistics.median(ratios[m]):.2f}" for m in rows) + " |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiers", default="avx512,avx512-noamx")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=196608)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--crossover", action="store_true", help="the kernel against dequantise + GEMM, 16-128 rows")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.crossover:
        crossover(args.rounds)
        return
    available = {t.name: t for t in build.tiers()}
    libs = {name: build.load(available[name], paths.cache_root() / "native") for name in args.tiers.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (args.n, args.k), dtype=torch.int8, generator=g)
    s = (torch.rand(args.n, generator=g) / 100).bfloat16()
    xs = {m: torch.randn(m, args.k, generator=g).bfloat16() for m in rows}
    ms: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = list(libs) if r % 2 == 0 else list(reversed(libs))
        for name in order:
            for m in rows:
                ms.setdefault((name, m), []).append(
                    timed(lambda: linear.gemv(libs[name], build.W_INT8, xs[m], w, args.n, s), 3))
    print(f"int8 weight {args.n}x{args.k} ({args.n * args.k / 2**20:.0f} MB), {args.threads} threads, "
          f"{args.rounds} alternating rounds; ms median (min-max), and against the same build's 1 row")
    print("\n| build | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in libs:
        one = statistics.median(ms[(name, rows[0])])
        cells = []
        for m in rows:
            v = ms[(name, m)]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) {statistics.median(v) / one:.2f}×")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
