"""The vision tower's int8 products where the CPU has VNNI and no AMX, per layer shape, alternating
in every round: oneDNN's int8 GEMM on prepacked weights with the activations in 8-bit codes per
row (`linear.int8_matmul`, what the tower ran before section 47) against qvl's byte-product
kernel with 8-bit codes per 64 columns (`linear.q8_linear`, what it runs now), each with the
fusions the tower asks of it (qkv: the layer norm; proj and fc2: the residual add; fc1: the layer
norm and tanh-GELU). bf16, or float32 with --fp32 (the avx512-nobf16 and avx2-vnni tiers).

    python benchmarks/vision_products.py --rows 1008 4032 --rounds 9
    python benchmarks/vision_products.py --before /work/wt-before --rows 1008 4032 270 --rounds 9

--before CHECKOUT: instead, this checkout's byte-product kernel against that checkout's (built
for the same tier from its sources), plain products without fusions (older kernels have none),
on the tower's shapes and 2B's decoder layers' (prefill); with --kernel i16 the 16-bit pair
kernel's (`linear.i16_linear`: prefill on plain AVX2, --int8-activations vision), e.g.

    QVL_ISA=avx2 python benchmarks/vision_products.py --before /work/wt-before --kernel i16 --fp32 --rows 1008 270

--tower MODEL: the whole vision tower both ways in one process (the tier's compute dtype), e.g. on
plain AVX2 (torch held to the tier as tiers.py does):

    QVL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/vision_products.py --tower /work/ckpt/qvl-2b --tokens 256 1024 --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from vision_attention import checkout_library

from qvl.kernels import linear
from qvl.kernels.library import Library, library
from qvl.kernels.plan import default_plan
from qvl.quantize import quantize_int8

VISION = {"qkv": (1024, 3072, "norm"), "proj": (1024, 1024, "residual"), "fc1": (1024, 4096, "norm, GELU"),
          "fc2": (4096, 1024, "residual")}  # 2B's tower: in, out, fusions
LAYERS = {"q/o": (2048, 2048, ""), "gate/up": (2048, 6144, ""), "down": (6144, 2048, "")}  # 2B's decoder


def alternate(sides: dict, rounds: int) -> dict[str, list[float]]:
    times = {name: [] for name in sides}
    for f in sides.values():
        f()  # warm
    for r in range(rounds):
        for name, f in (list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]):
            started = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - started) * 1e3)
    return times


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


@contextlib.contextmanager
def without_byte_kernel():
    """Within it, the plan sees no byte kernel (as a build without one: AVX-512 without VNNI), so
    engines loaded there run the vision tower's int8 x int8 products through oneDNN's GEMM."""
    byte_kernel = Library.q8_levels
    Library.q8_levels = property(lambda self: 0)
    try:
        yield
    finally:
        Library.q8_levels = byte_kernel


def tower(args) -> None:
    """--tower MODEL: the whole vision tower (the 1920x1080 photo at each --tokens) loaded twice in
    one process, its int8 x int8 products through oneDNN's GEMM (codes per row, as a build
    without the byte kernel runs it) and through the byte kernel, encoding in turn."""
    from qvl.bench import synthetic_image
    from qvl.engine import Engine, EngineOptions
    from qvl.processing.image import max_pixels_for_tokens, preprocess

    options = EngineOptions(model=args.tower, threads=args.threads, weights="int8", int8_activations="vision")
    with without_byte_kernel():
        onednn = Engine.load(options)
    byte = Engine.load(options)
    print(f"tier {library().tier.name}, {byte.model.dtype}, {args.rounds} rounds\n\n| image tokens | oneDNN per row ms "
          f"| qvl per 64 columns ms | qvl / oneDNN (median of rounds) |\n|---|---|---|---|")
    for tokens in args.tokens:
        processed = preprocess(synthetic_image(1920, 1080), byte.image_cfg,
                               max_pixels=max_pixels_for_tokens(tokens, byte.image_cfg))
        with torch.inference_mode():
            t = alternate({name: lambda e=e: e.model.encode_images(processed.pixel_values, [processed.grid_thw])
                           for name, e in (("a", onednn), ("b", byte))}, args.rounds)
        ratio = statistics.median([b / a for a, b in zip(t["a"], t["b"])])
        print(f"| {tokens} | {spread(t['a'])} | {spread(t['b'])} | {ratio:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1008, 4032])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--before", help="a checkout whose byte-product kernel (same tier) runs beside this one's")
    p.add_argument("--kernel", choices=["q8", "i16"], default="q8", help="with --before: which kernel")
    p.add_argument("--tower", metavar="MODEL", help="instead: the whole vision tower of MODEL, both ways (see tower)")
    p.add_argument("--tokens", type=int, nargs="+", default=[256], help="with --tower: the photo's image tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.tower:
        return tower(args)
    k, dtype = library(), torch.float32 if args.fp32 else torch.bfloat16
    pairs = args.before and args.kernel == "i16"
    if not (default_plan(dtype).pair_products if pairs else default_plan(dtype).group_codes):
        raise SystemExit(f"this CPU (or tier) has no {'16-bit pair' if pairs else 'byte'} products for this dtype")
    product = linear.i16_linear if pairs else linear.q8_linear
    before = checkout_library(args.before) if args.before else None
    names = ("before", "now") if before else ("oneDNN per row", "qvl per 64 columns")
    print(f"| shape | rows | {names[0]} ms | {names[1]} ms | {names[1]} / {names[0]} |\n|---|---|---|---|---|")
    totals = {rows: [0.0, 0.0] for rows in args.rows}
    shapes = {**VISION, **LAYERS} if before else VISION
    for name, (k_in, n, fusions) in shapes.items():
        q, s = quantize_int8(torch.randn(n, k_in) / k_in**0.5)
        s, bias = s.to(dtype), torch.randn(n).to(dtype)
        packed, colsums = linear.pack_int8(q), q.sum(1, dtype=torch.int32).float()
        norm = ((torch.rand(k_in) + 0.5).to(dtype), torch.randn(k_in).to(dtype), 1e-6)
        for rows in args.rows:
            x, residual = torch.randn(rows, k_in).to(dtype), torch.randn(rows, n).to(dtype)
            if before:
                sides = {"a": lambda: product(before, x, q, s, bias),
                         "b": lambda: product(k.lib, x, q, s, bias)}
            else:
                fused = dict(gelu_tanh="GELU" in fusions, residual=residual if "residual" in fusions else None,
                             layer_norm=norm if "norm" in fusions else None)
                sides = {"a": lambda: linear.int8_matmul(k.lib, x, packed, colsums, s, bias, k.int8_levels, **fused),
                         "b": lambda: linear.q8_linear(k.lib, x, q, s, bias, **fused)}
            t = alternate(sides, args.rounds)
            ratio = statistics.median([b / a for a, b in zip(t["a"], t["b"])])
            label = f"{name} ({k_in} -> {n}{', ' + fusions if fusions and not before else ''})"
            print(f"| {label} | {rows} | {spread(t['a'])} | {spread(t['b'])} | {ratio:.2f} |", flush=True)
            if name in VISION:
                totals[rows][0] += statistics.median(t["a"])
                totals[rows][1] += statistics.median(t["b"])
    for rows, (a, b) in totals.items():
        print(f"\none vision block's four products at {rows} rows: {a:.1f} ms against {b:.1f}: {b / a:.2f}")


if __name__ == "__main__":
    main()
