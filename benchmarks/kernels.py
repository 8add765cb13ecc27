"""qvl's native kernels one call at a time, against torch's way of computing the same thing (and,
with --before, against another checkout's build of the same kernels), the sides alternating
within each round; per side the median (min-max) over --rounds of the median of --repeat calls,
and its time against torch's side (the median of the rounds' own ratios). Rows: activation rows,
patches, queries or decoding rows.

    python benchmarks/kernels.py gemv
    python benchmarks/kernels.py products --shapes vision text --rows 270 1008
    python benchmarks/kernels.py products --weights int4
    python benchmarks/kernels.py attention --kinds vision prefill decode
    python benchmarks/kernels.py products --tier avx2        # an older CPU emulated on this one
    git worktree add /work/wt-before <commit>
    python benchmarks/kernels.py gemv --before /work/wt-before

gemv       The decode GEMV (qvl_linear) per weight format (bf16, int8, int4 in groups of 128) at
           --rows activation rows, over --matrices weights of 6144 x 2048 (more bytes than the
           caches hold, as a model's layers): ms per pass, GB/s of weights streamed, the time
           against one row's, and against torch's weight-only kernels (F.linear on bf16 weights,
           _weight_int8pack_mm, _weight_int4pack_mm_for_cpu).
products   Many-row products of int8 (or int4) weights on the 2B vision tower's shapes (qkv,
           proj, fc1, fc2; 1008 rows: a photo at 256 image tokens) and the 2B decoder's (q/o,
           gate/up, down; 270 rows: that photo's prompt): every native kernel this build takes
           them with (the byte kernel in 8-bit codes per 64 columns, the 16-bit pair kernel, AMX
           int8 tiles with 16-bit codes, AMX bf16 tiles, oneDNN's int8 GEMM around qvl's quantise
           and rescale passes, AMX int8 tiles rescaling in cache), against dequantising the weight
           for torch's GEMM. --fused: the vision shapes with the tower's fusions (layer norm,
           tanh-GELU, residual add), torch's side doing them apart; kernels without them are left out.
attention  The vision tower's attention (the flash kernel in bf16, in 8-bit codes where the build
           has VNNI and BF16 without AMX, in 16-bit integer codes in float32) on 1008 and 4032
           patches of 16 heads of 64 and of 72; prefill's causal attention over the paged cache
           (one 2B layer: 16 query heads over 8 key/value heads of 128, or --prefill-heads; prompts
           of 280 and 1030 tokens, and the last 64 of 1030, or --prompts); decode attention over
           2048 cached positions for 1 and 8 rows. Against torch's SDPA on the same keys and
           values (prefill: gathered from the pool in the call, as ops.cache_attention does; the
           others beforehand), with each side's largest difference from SDPA in float32 (float64
           for float32 inputs). Qwen3.5 2B's full attention at 4000 tokens:
           attention --kinds prefill --prefill-heads 8 2 256 --prompts 4000

The compute dtype is the tier's (bf16 where it has bf16 products, else float32) unless --dtype
says otherwise. --tier NAME reruns the script with qvl's kernels and torch's held to that tier
(QVL_ISA and torch's switches). --before CHECKOUT builds that checkout's kernels for this
process's tier from its sources and runs them beside this checkout's through this checkout's
bindings (its C functions must take the same arguments).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import common
from qvl.kernels import attention, build, linear
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan
from qvl.kernels.products import dequantize_int4, dequantize_int8
from qvl.kv_cache import BLOCK
from qvl.quantize import pack_nibbles, quantize_int4, quantize_int8

GROUP = 128  # int4 weights: inputs per scale and zero
VISION = {"qkv": (1024, 3072, "norm"), "proj": (1024, 1024, "residual"), "fc1": (1024, 4096, "norm, GELU"),
          "fc2": (4096, 1024, "residual")}  # 2B's tower: in, out, the fusions it runs
TEXT = {"q/o": (2048, 2048, ""), "gate/up": (2048, 6144, ""), "down": (6144, 2048, "")}  # 2B's decoder
PATCHES = [(1008, 16, 64), (4032, 16, 64), (1008, 16, 72), (4032, 16, 72)]  # vision attention: tokens, heads, size
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # the 2B decoder's attention


# -- the libraries, the rounds and the table ---------------------------------------------------

def checkout_library(checkout: str):
    """The kernels of another checkout, built for this process's tier from its sources."""
    out = tempfile.mkdtemp(prefix="qvl-before-")
    code = ("import sys\nfrom pathlib import Path\nfrom qvl.kernels import build\n"
            "print(build.build(Path(sys.argv[1]), build.select_tier()))")
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve() / "src")}
    path = subprocess.run([sys.executable, "-c", code, out], env=env, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    return build.open_library(Path(path))


def libraries(args) -> dict[str, object]:
    """Side tag -> library: '' for this checkout's, ' (before)' for --before's."""
    if library().lib is None:
        raise SystemExit(f"the native kernels are not available here: {library().reason}")
    libs = {"": library().lib}
    if args.before:
        libs[" (before)"] = checkout_library(args.before)
    return libs


def measure(sides: dict, args) -> dict[str, list[float]]:
    """Side -> its ms per round (the median of --repeat calls), in alternating rounds; sides that
    decline the inputs (return None) are left out."""
    taken = {name: fn for name, fn in sides.items() if fn() is not None}
    return common.alternate({name: lambda fn=fn: common.time_call(fn, args.repeat) * 1e3
                             for name, fn in taken.items()}, args.rounds)


def header(against: str, *extra: str) -> None:
    cells = ["shape", "rows", "side", "ms median (min-max)", f"time vs {against}", *extra]
    print("| " + " | ".join(cells) + " |\n|" + "---|" * len(cells), flush=True)


def print_rows(shape: str, rows: int, times: dict[str, list[float]], base: str, extra=None) -> None:
    """One table row per side: its ms and its time against `base`'s (median of the rounds' own
    ratios), and extra(side)'s cells."""
    for side, ms in times.items():
        cells = [shape, str(rows), side, common.spread(ms), f"{common.round_ratio(ms, times[base]):.2f}"]
        print("| " + " | ".join(cells + ([extra(side)] if extra else [])) + " |", flush=True)


def largest_difference(sides: dict, reference: torch.Tensor):
    """extra(side) for print_rows: the side's largest difference from `reference`."""
    return lambda side: f"{(sides[side]().to(reference.dtype) - reference).abs().max().item():.4f}"


# -- gemv -------------------------------------------------------------------------------------

def gemv(args, dtype: torch.dtype) -> None:
    libs, n, k = libraries(args), 6144, 2048
    header("torch", "GB/s", "vs its 1 row")
    for fmt in ("bf16", "int8", "int4"):
        ours, theirs, nbytes = gemv_calls(fmt, n, k, dtype, args.matrices)
        first: dict[str, float] = {}
        for rows in args.rows:
            x = torch.randn(rows, k).to(dtype)
            sides = {"torch": lambda: theirs(x), **{f"qvl{tag}": lambda lib=lib: ours(lib, x)
                                                    for tag, lib in libs.items()}}
            times = measure(sides, args)
            med = {side: statistics.median(ms) for side, ms in times.items()}
            first = first or med
            print_rows(f"{fmt}, {args.matrices} x {n}x{k}", rows, times, "torch",
                       lambda side: f"{nbytes / med[side] / 1e6:.1f} | {med[side] / first.get(side, med[side]):.2f}")


def gemv_calls(fmt: str, n: int, k: int, dtype: torch.dtype, count: int):
    """(qvl(lib, x), torch(x), bytes of weights): one pass of each over `count` distinct [n, k]
    weights in `fmt`, x [rows, k] in the compute dtype."""
    w = torch.randn(n, k) / k**0.5
    if fmt == "bf16":
        mats = [w.bfloat16() for _ in range(count)]
        return (lambda lib, x: [linear.gemv(lib, build.W_BF16, x, m, n) for m in mats],
                lambda x: [F.linear(x.bfloat16(), m) for m in mats], 2 * n * k * count)
    if fmt == "int8":
        q, s = quantize_int8(w)
        mats, s = [q.clone() for _ in range(count)], s.to(dtype)
        return (lambda lib, x: [linear.gemv(lib, build.W_INT8, x, m, n, s) for m in mats],
                lambda x: [torch._weight_int8pack_mm(x, m, s) for m in mats], n * k * count)
    codes, s, z = quantize_int4(w, GROUP)
    mats, s, z = [pack_nibbles(codes) for _ in range(count)], s.to(dtype), z.to(dtype)
    packed = [torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1) for _ in range(count)]
    scales_zeros = torch.stack([s.t(), z.t()], -1).contiguous()  # [k / GROUP, n, 2], torch's layout
    return (lambda lib, x: [linear.gemv(lib, build.W_INT4, x, m, n, s, z, GROUP) for m in mats],
            lambda x: [torch._weight_int4pack_mm_for_cpu(x, m, GROUP, scales_zeros) for m in packed],
            n * k // 2 * count)


# -- products ---------------------------------------------------------------------------------

def products(args, dtype: torch.dtype) -> None:
    libs = libraries(args)
    shapes = {**({f"vision {name}": shape for name, shape in VISION.items()} if "vision" in args.shapes else {}),
              **({f"text {name}": shape for name, shape in TEXT.items()} if "text" in args.shapes else {})}
    header("dequantise + GEMM")
    for name, (k, n, fusions) in shapes.items():
        fused = fusions if args.fused and args.weights == "int8" else ""
        w = torch.randn(n, k) / k**0.5
        bias = torch.randn(n).to(dtype) if name.startswith("vision") else None
        norm = ((torch.rand(k) + 0.5).to(dtype), torch.randn(k).to(dtype), 1e-6) if "norm" in fused else None
        for rows in args.rows:
            x = torch.randn(rows, k).to(dtype)
            residual = torch.randn(rows, n).to(dtype) if "residual" in fused else None
            if args.weights == "int8":
                sides = int8_sides(libs, w, x, bias, dtype, dict(gelu_tanh="GELU" in fused, residual=residual,
                                                                 layer_norm=norm))
            else:
                sides = int4_sides(libs, w, x, bias, dtype)
            label = f"{name} ({k} -> {n}{', ' + fused if fused else ''})"
            print_rows(label, rows, measure(sides, args), "dequantise + GEMM")


def int8_sides(libs: dict, w: torch.Tensor, x: torch.Tensor, bias, dtype: torch.dtype, fused: dict) -> dict:
    """Every way this build takes x @ int8(w).T (+ bias), with the fusions in `fused`
    (gelu_tanh, residual, layer_norm) where the kernel has them; kernels without them are left
    out when any is asked for."""
    q, s = quantize_int8(w)
    s, (n, k) = s.to(dtype), q.shape
    plain = not (fused["gelu_tanh"] or fused["residual"] is not None or fused["layer_norm"] is not None)
    norm, residual = fused["layer_norm"], fused["residual"]

    def torch_side():
        h = x if norm is None else F.layer_norm(x, (k,), norm[0], norm[1], norm[2])
        y = F.linear(h, dequantize_int8(q, s, transient=True), bias)
        y = F.gelu(y, approximate="tanh") if fused["gelu_tanh"] else y
        return y if residual is None else residual + y

    plan, amx, colsums = default_plan(dtype), library().has(build.AMX_INT8), q.sum(1, dtype=torch.int32).float()
    packed = linear.pack_int8(q) if library().int8_levels else None
    tiles = linear.amx_pack_int8(library().lib, q) if amx and linear.amx_tiles_take(n, k) else None
    sides = {"dequantise + GEMM": torch_side}
    for tag, lib in libs.items():
        if plan.group_codes:
            sides["byte kernel" + tag] = lambda lib=lib: linear.q8_linear(lib, x, q, s, bias, **fused)
        if plan.pair_products and plain:
            sides["16-bit pairs" + tag] = lambda lib=lib: linear.i16_linear(lib, x, q, s, bias)
        if amx and plain:
            sides["AMX int8 tiles, 16-bit codes" + tag] = lambda lib=lib: linear.amx_i16_linear(lib, x, q, s, bias)
        if amx and plain and dtype == torch.bfloat16:
            sides["AMX bf16 tiles" + tag] = lambda lib=lib: linear.amx_bf16_linear(lib, build.W_INT8, x, q, s,
                                                                                   bias=bias)
        if packed is not None:
            sides["oneDNN int8 GEMM" + tag] = lambda lib=lib: linear.int8_matmul(
                lib, x, packed, colsums, s, bias, library().int8_levels, **fused)
        if tiles is not None:
            sides["AMX int8 tiles, rescaled in cache" + tag] = lambda lib=lib: linear.int8_matmul(
                lib, x, tiles, colsums, s, bias, 255, amx=True, **fused)
    return sides


def int4_sides(libs: dict, w: torch.Tensor, x: torch.Tensor, bias, dtype: torch.dtype) -> dict:
    """x @ int4(w).T (+ bias): dequantise + GEMM, the byte kernel in 8-bit codes (and, for the
    ratio int4's prefill rests on, the same kernel on int8(w)), and AMX bf16 tiles where the build
    has them."""
    codes, s, z = quantize_int4(w, GROUP)
    q, s, z = pack_nibbles(codes), s.to(dtype), z.to(dtype)
    sides = {"dequantise + GEMM": lambda: F.linear(x, dequantize_int4(q, s, z, GROUP, transient=True), bias)}
    if default_plan(dtype).group_codes:
        q8, s8 = quantize_int8(w)
        s8 = s8.to(dtype)
        for tag, lib in libs.items():
            sides["byte kernel" + tag] = lambda lib=lib: linear.q4_linear(lib, x, q, s, z, GROUP, bias)
            sides["byte kernel, int8 weights" + tag] = lambda lib=lib: linear.q8_linear(lib, x, q8, s8, bias)
    if library().has(build.AMX_INT8) and dtype == torch.bfloat16:
        for tag, lib in libs.items():
            sides["AMX bf16 tiles" + tag] = lambda lib=lib: linear.amx_bf16_linear(lib, build.W_INT4, x, q, s, z,
                                                                                   GROUP, bias)
    return sides


# -- attention --------------------------------------------------------------------------------

def attention_kernels(args, dtype: torch.dtype) -> None:
    libs, plan = libraries(args), default_plan(dtype)
    exact = torch.float64 if dtype == torch.float32 else torch.float32
    header("SDPA", f"largest difference from SDPA in {str(exact)[6:]}")
    if "vision" in args.kinds:
        vision_attention(args, libs, plan, exact)
    if "prefill" in args.kinds:
        if plan.bf16_products:
            prefill_attention(args, libs)
        else:
            print(f"| prefill | - | - | {str(dtype)[6:]}: torch's SDPA, no native kernel to compare | - | - |")
    if "decode" in args.kinds:
        decode_attention(args, libs, dtype, exact)


def vision_attention(args, libs: dict, plan, exact: torch.dtype) -> None:
    """The tower's attention (no mask), q, k, v strided as the fused qkv gives them."""
    bf16 = plan.dtype == torch.bfloat16
    q8 = plan.bf16_products and library().has(build.VNNI) and not library().tier.amx
    i16 = plan.native and library().has(build.AVX2) and not bf16

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)

    torch.manual_seed(0)
    for n, h, d in PATCHES:
        q, k, v = torch.randn(n, 3, h, d).to(plan.dtype).unbind(1)
        sides = {"SDPA": lambda: sdpa(q, k, v)}
        for tag, lib in libs.items():
            if plan.bf16_products:
                sides["flash" + tag] = lambda lib=lib: attention.attention(lib, q, k, v)
            if q8:
                sides["8-bit codes" + tag] = lambda lib=lib: attention.attention_q8(lib, q, k, v)
            if i16:
                sides["16-bit codes" + tag] = lambda lib=lib: attention.attention_i16(lib, q, k, v)
        times = measure(sides, args)
        reference = sdpa(q.to(exact), k.to(exact), v.to(exact))
        print_rows(f"vision, {h} heads of {d}", n, times, "SDPA", largest_difference(sides, reference))


def prefill_attention(args, libs: dict) -> None:
    """One layer's causal attention (--prefill-heads) over a paged cache (bf16) whose blocks are
    shuffled, per --prompts LENGTH[:QUERIES] (the last QUERIES tokens of a LENGTH-token prompt).
    SDPA as ops.cache_attention runs it: the row's blocks gathered, is_causal for a whole prompt."""
    heads, kv_heads, head_dim = args.prefill_heads
    torch.manual_seed(0)
    for prompt in args.prompts:
        length, queries = (int(x) for x in (prompt.split(":") if ":" in prompt else (prompt, prompt)))
        start, blocks = length - queries, -(-length // BLOCK)
        keys, values = (torch.randn(blocks, kv_heads, BLOCK, head_dim).bfloat16() for _ in range(2))
        table = torch.randperm(blocks)
        q = (torch.randn(queries, heads, head_dim) * 2).bfloat16()
        mask = (torch.arange(length)[None, :] <= torch.arange(start, length)[:, None])[None, None] if start else None

        def sdpa(dt=torch.bfloat16):
            k, v = (x[table].transpose(0, 1).reshape(1, kv_heads, -1, head_dim)[:, :, :length].to(dt)
                    for x in (keys, values))  # [1, kv_heads, length, head_dim], as KVCache.gather gives SDPA
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(dt), k, v, attn_mask=mask,
                                                  is_causal=mask is None, enable_gqa=True)[0].transpose(0, 1)

        sides = {"SDPA": sdpa, **{"flash" + tag: lambda lib=lib: attention.paged_attention(lib, q, keys, values, table,
                                                                                          start)
                                  for tag, lib in libs.items()}}
        times = measure(sides, args)
        print_rows(f"prefill, {length}-token prompt, {heads}/{kv_heads} heads of {head_dim}", queries, times, "SDPA",
                   largest_difference(sides, sdpa(torch.float32)))


def decode_attention(args, libs: dict, dtype: torch.dtype, exact: torch.dtype) -> None:
    """One query per row over 2048 cached positions of a 2B layer, each row's blocks shuffled in the pool."""
    torch.manual_seed(0)
    length = 2048
    for rows in (1, 8):
        per_row = length // BLOCK
        keys, values = (torch.randn(rows * per_row, KV_HEADS, BLOCK, HEAD_DIM).to(dtype) for _ in range(2))
        table, lengths = torch.randperm(rows * per_row).view(rows, per_row), torch.full((rows,), length)
        q = torch.randn(rows, HEADS, 1, HEAD_DIM).to(dtype)
        k, v = (x[table].transpose(1, 2).reshape(rows, KV_HEADS, length, HEAD_DIM).contiguous()
                for x in (keys, values))  # [rows, KV_HEADS, length, HEAD_DIM]

        def sdpa(dt=dtype):
            return F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), enable_gqa=True)

        sides = {"SDPA": sdpa, **{"qvl" + tag: lambda lib=lib: attention.decode_attention(lib, q, keys, values, table,
                                                                                         lengths)
                                  for tag, lib in libs.items()}}
        times = measure(sides, args)
        print_rows(f"decode, {length} positions", rows, times, "SDPA", largest_difference(sides, sdpa(exact)))


# -- the command line -------------------------------------------------------------------------

def main() -> None:
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--rounds", type=int, default=7)
    shared.add_argument("--repeat", type=int, default=3, help="calls per side and round (their median counts)")
    shared.add_argument("--threads", type=int, default=2)
    shared.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="compute dtype (auto: bf16 where the tier has bf16 products, else fp32)")
    shared.add_argument("--tier", help="emulate this kernel tier of the CPU (QVL_ISA and torch's switches)")
    shared.add_argument("--before", metavar="CHECKOUT", help="also that checkout's kernels (same tier)")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True)
    g = modes.add_parser("gemv", parents=[shared], help="the decode GEMV per weight format and row count")
    g.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    g.add_argument("--matrices", type=int, default=32, help="distinct weights per pass (more bytes than the caches)")
    m = modes.add_parser("products", parents=[shared], help="many-row int8 / int4 products")
    m.add_argument("--shapes", nargs="+", choices=["vision", "text"], default=["vision", "text"])
    m.add_argument("--rows", type=int, nargs="+", default=[270, 1008])
    m.add_argument("--weights", choices=["int8", "int4"], default="int8")
    m.add_argument("--fused", action="store_true", help="int8: the vision shapes with the tower's fusions")
    a = modes.add_parser("attention", parents=[shared], help="vision, prefill and decode attention")
    kinds = ["vision", "prefill", "decode"]
    a.add_argument("--kinds", nargs="+", choices=kinds, default=kinds)
    a.add_argument("--prefill-heads", type=int, nargs=3, metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
                   default=[HEADS, KV_HEADS, HEAD_DIM], help="prefill's layer (Qwen3.5 2B's full attention: 8 2 256)")
    a.add_argument("--prompts", nargs="+", default=["280", "1030", "1030:64"], metavar="LENGTH[:QUERIES]",
                   help="prefill: prompts of LENGTH tokens, the last QUERIES of them queried (default: all)")
    args = p.parse_args()
    if args.tier and os.environ.get("QVL_ISA") != args.tier:
        os.execve(sys.executable, [sys.executable, *sys.argv], common.tier_env(args.tier))
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or (
        torch.bfloat16 if library().tier.bf16 else torch.float32)
    print(f"{library().describe()}; {str(dtype)[6:]}, {args.threads} threads, {args.rounds} alternating rounds of "
          f"{args.repeat} calls\n")
    {"gemv": gemv, "products": products, "attention": attention_kernels}[args.mode](args, dtype)


if __name__ == "__main__":
    main()
