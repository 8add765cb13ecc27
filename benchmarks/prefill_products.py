"""Prefill's int8 (or int4) products on AMX: the bf16 tile kernel (weights converted to bf16
panel by panel, `qvl.kernels.linear.amx_bf16_linear`) against dequantising the weight and running
oneDNN's bf16 GEMM (what CPUs without AMX run), and for int8 weights the int8 tile kernel with 16-bit
activation codes (`linear.amx_i16_linear`, what prefill runs on AMX since section 36), on 2B's
and 8B's layer shapes, alternating in every round.

    python benchmarks/prefill_products.py --rows 100 264 1000 --rounds 5
    python benchmarks/prefill_products.py --kind int4 --rows 100 264 512 --rounds 3

On x86 without AMX (or a tier emulated as such: QVL_ISA plus torch's switches, see tiers.py) it
compares instead, in the tier's compute dtype (bf16 where it has bf16 products, else float32),
the 16-bit pair kernel (`linear.i16_linear`, prefill's int8 products there since section 37)
with dequantising the weight for the tier's GEMM (oneDNN's bf16, MKL's float32: before), and
where the CPU has VNNI the 8-bit group-code kernel (`linear.q8_linear`, prefill's default there
since section 40) with the 16-bit pair kernel.

Prints per shape the median ms (min-max) of each side and the ratios to dequantise + GEMM; "n/a"
where the bf16 tile kernel does not take the product (more than 2^21 activation values: amx.c).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from compare import median_time

from qvl.kernels import build, linear
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan
from qvl.kernels.products import dequantize_int4, dequantize_int8
from qvl.quantize import pack_nibbles, quantize_int4, quantize_int8

SHAPES = {"2B q/o (2048 -> 2048)": (2048, 2048), "2B gate/up (2048 -> 6144)": (2048, 6144),
          "2B down (6144 -> 2048)": (6144, 2048), "8B gate/up (4096 -> 12288)": (4096, 12288)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[100, 264, 1000])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kind", choices=["int8", "int4"], default="int8")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = library()
    if k.lib is not None and not k.has(build.AMX_INT8) and default_plan(torch.float32).pair_products:
        return x86_tier(args, k)
    if k.lib is None or not k.has(build.AMX_INT8):
        raise SystemExit("this CPU (or build) has neither AMX tiles nor the 16-bit pair kernel")
    int8 = args.kind == "int8"
    print("| shape | rows | " + ("int8 tiles, 16-bit codes ms | " if int8 else "") + "AMX bf16 tiles ms | "
          "dequantise + GEMM ms | " + ("int8 tiles / dequantise | " if int8 else "") + "bf16 tiles / dequantise |")
    print("|---" * (7 if int8 else 5) + "|")
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K) / K**0.5
        if int8:
            q, s = quantize_int8(w)
            s, z, code = s.to(torch.bfloat16), None, build.W_INT8
            dequantized = lambda: dequantize_int8(q, s, transient=True)  # noqa: E731
        else:
            codes, s, z = quantize_int4(w, 128)
            q, s, z, code = pack_nibbles(codes), s.to(torch.bfloat16), z.to(torch.bfloat16), build.W_INT4
            dequantized = lambda: dequantize_int4(q, s, z, 128, transient=True)  # noqa: E731
        for rows in args.rows:
            x = torch.randn(rows, K).to(torch.bfloat16)
            sides = {"dequant": lambda: F.linear(x, dequantized())}
            if linear.amx_bf16_linear(k.lib, code, x, q, s, z, 128) is not None:  # else past its 2^21 activations
                sides["tiles"] = lambda: linear.amx_bf16_linear(k.lib, code, x, q, s, z, 128)
            if int8:
                sides["i16"] = lambda: linear.amx_i16_linear(k.lib, x, q, s)
            times = alternate(sides, args.rounds)

            def spread(side):
                v = times.get(side)
                return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "n/a (not taken)"

            def ratio(side):
                v = times.get(side)
                return f"{statistics.median([a / b for a, b in zip(v, times['dequant'])]):.2f}" if v else ""

            cells = ([spread("i16")] if int8 else []) + [spread("tiles"), spread("dequant")]
            cells += ([ratio("i16")] if int8 else []) + [ratio("tiles")]
            print(f"| {name} | {rows} | " + " | ".join(cells) + " |", flush=True)


def alternate(sides: dict, rounds: int) -> dict[str, list[float]]:
    """side -> its ms per round (median of 3 calls), the sides' order reversed every other round."""
    times = {side: [] for side in sides}
    for rnd in range(rounds):
        for side in (list(sides) if rnd % 2 == 0 else list(sides)[::-1]):
            times[side].append(median_time(sides[side], 3) * 1000)
    return times


def x86_tier(args, k) -> None:
    dtype = torch.bfloat16 if k.tier.bf16 else torch.float32
    bytes_ = default_plan(dtype).group_codes  # the byte kernel runs here (8-bit codes with VNNI, 7-bit on plain AVX2)
    print(f"tier {k.tier.name}: {dtype}, int8 weights\n")
    head = "| shape | rows | " + (f"{k.q8_code_bits}-bit group codes ms | " if bytes_ else "") + "16-bit pairs ms | dequantise + GEMM ms | "
    head += ("pairs / group codes | " if bytes_ else "") + "dequantise / pairs |"
    print(head + "\n" + "|---" * (7 if bytes_ else 5) + "|")
    for name, (K, N) in SHAPES.items():
        q, s = quantize_int8(torch.randn(N, K) / K**0.5)
        s = s.to(dtype)
        for rows in args.rows:
            x = torch.randn(rows, K).to(dtype)
            sides = {"pairs": lambda: linear.i16_linear(k.lib, x, q, s),
                     "dequant": lambda: F.linear(x, dequantize_int8(q, s, transient=True))}
            if bytes_:
                sides = {"bytes": lambda: linear.q8_linear(k.lib, x, q, s), **sides}
            times = alternate(sides, args.rounds)
            cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in times.values()]
            ratio = lambda a, b: statistics.median([u / v for u, v in zip(times[a], times[b])])  # noqa: E731
            ratios = ([f"{ratio('pairs', 'bytes'):.2f}×"] if bytes_ else []) + [f"{ratio('dequant', 'pairs'):.2f}×"]
            print(f"| {name} | {rows} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)


if __name__ == "__main__":
    main()
