"""The vision tower's attention, one call per shape: qvl's native kernel (on AMX-BF16 tiles
where the CPU has them) against torch's SDPA, alternating, medians (min-max) of --rounds; and
each side's largest difference from SDPA in float32. --integer: float32 inputs, qvl's 16-bit
integer kernel (qvl_attention_i16, what the float32 tiers run where the tower's linears are int8
x int8) against torch's float32 SDPA, differences from float64. Where the tier has it (AVX-512
with VNNI and BF16, no AMX), bf16 runs add the kernel in 8-bit codes
(qvl_attention_q8, what those CPUs run where the tower's linears are int8 x int8) against qvl's
bf16 kernel.

    python benchmarks/vision_attention.py --rounds 7
    python benchmarks/vision_attention.py --integer --rounds 7
    QVL_ISA=avx512-nobf16 python benchmarks/vision_attention.py --integer --before /work/wt-head --rounds 7

--before CHECKOUT: also that checkout's kernel, built for the same tier (QVL_ISA) from its
sources, the three sides alternating in each round; the table adds its times, after/before and
its largest difference from SDPA in float32.

Shapes: 2B's tower at 256 and 1024 image tokens (1008 and 4032 patches, 16 heads of 64) and
the 1152-wide towers' at 256 and 1024 (16 heads of 72).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qvl.kernels import attention, build
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan

SHAPES = [(1008, 16, 64), (4032, 16, 64), (1008, 16, 72), (4032, 16, 72)]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)


def spread(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"


def checkout_library(checkout: str):
    """The kernels of another checkout, built for this process's tier from its sources."""
    out = tempfile.mkdtemp(prefix="qvl-before-")
    code = ("import sys\nfrom pathlib import Path\n"
            "try:\n    from qvl.kernels import build\n"
            "except ImportError:  # a checkout from before qvl.kernels\n    from qvl import native as build\n"
            "print(build.build(Path(sys.argv[1]), build.select_tier()))")
    env = {**os.environ, "PYTHONPATH": str(Path(checkout) / "src")}
    path = subprocess.run([sys.executable, "-c", code, out], env=env, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    return build.open_library(Path(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--integer", action="store_true", help="float32: qvl_attention_i16 against SDPA")
    p.add_argument("--before", help="a checkout whose kernel (same tier) runs beside this one's")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = library()
    print(f"vision attention: {default_plan(torch.bfloat16).image_attention} ({k.describe()}); "
          f"{args.threads} threads\n")
    dtype = torch.float32 if args.integer else torch.bfloat16
    def kernel_of(lib):
        return (lambda q, kk, v: attention.attention_i16(lib, q, kk, v)) if args.integer else \
            (lambda q, kk, v: attention.attention(lib, q, kk, v))

    kernel = kernel_of(k.lib)
    before = kernel_of(checkout_library(args.before)) if args.before else None
    exact = torch.float64 if args.integer else torch.float32
    byte_scores = not args.integer and k.byte_vision_attention(dtype)
    extra = (" byte scores ms | byte scores / qvl | byte scores' max diff |" if byte_scores else "") + (
        " before ms | qvl / before | before's max diff |" if before else "")
    print(f"| patches, heads x size | SDPA ms | qvl ms | qvl / SDPA | max diff SDPA, qvl (vs {exact}) |{extra}")
    print("|---|---|---|---|---|" + "---|---|---|" * (bool(byte_scores) + bool(before)))
    torch.manual_seed(0)
    for n, h, d in SHAPES:
        q, kk, v = torch.randn(n, 3, h, d).to(dtype).unbind(1)  # strided, as the fused qkv gives them
        covered = k.integer_vision_attention(dtype) if args.integer else k.vision_attention(dtype)
        ours = kernel(q, kk, v) if covered else None
        if ours is None:
            print(f"| {n}, {h} x {d} | - | - | (no native kernel for this shape) | |")
            continue
        ref = sdpa(q.to(exact), kk.to(exact), v.to(exact))
        diffs = [(sdpa(q, kk, v).to(exact) - ref).abs().max().item(), (ours.to(exact) - ref).abs().max().item()]
        sides = [("sdpa", lambda: sdpa(q, kk, v)), ("qvl", lambda: kernel(q, kk, v))]
        if before:
            sides.append(("before", lambda: before(q, kk, v)))
        if byte_scores:
            sides.append(("bytes", lambda: attention.attention_q8(k.lib, q, kk, v)))
        times = {name: [] for name, _ in sides}
        for r in range(args.rounds):
            for side, run in (sides if r % 2 == 0 else sides[::-1]):
                started = time.perf_counter()
                run()
                times[side].append(time.perf_counter() - started)
        ratio = statistics.median(times["qvl"]) / statistics.median(times["sdpa"])
        row = (f"| {n}, {h} x {d} | {spread(times['sdpa'])} | {spread(times['qvl'])} | {ratio:.2f} | "
               f"{diffs[0]:.4f}, {diffs[1]:.4f} |")
        if byte_scores:
            mine = attention.attention_q8(k.lib, q, kk, v)
            row += (f" {spread(times['bytes'])} | {statistics.median(times['bytes']) / statistics.median(times['qvl']):.2f} |"
                    f" {(mine.to(exact) - ref).abs().max().item():.4f} |")
        if before:
            theirs = before(q, kk, v)
            was = float("nan") if theirs is None else (theirs.to(exact) - ref).abs().max().item()
            row += (f" {spread(times['before'])} | {statistics.median(times['qvl']) / statistics.median(times['before']):.2f} |"
                    f" {was:.4f} |")
        print(row, flush=True)


if __name__ == "__main__":
    main()
