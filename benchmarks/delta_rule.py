"""Gated DeltaNet's ops on one layer of the Qwen3.5 2B shape (16 key and 16 value heads of 128,
6144 convolution channels of 4 taps), the sides alternating within each round; per side the
median (min-max) over --rounds of the median of --repeat calls, and the median of the rounds'
own ratios against the torch reference and against the full-attention layer's attention.

prefill  conv + delta rule of a --length-token prompt (default 4000), natively at each chunk
         size of --chunks (the first is CHUNK's side when it is listed), against the torch
         reference (qvl.kernels.delta_rule) and against a full-attention layer's attention at the
         same length (the 2B's 8 query and 2 key/value heads of 256, bf16: qvl_attention over the
         paged cache where the build takes that head size, else torch's SDPA, as the layer runs it). The convolution alone, native against torch, on its own rows.
decode   one decode step (conv + delta rule) of --rows rows over a pool of states, native against
         the torch reference.

    python benchmarks/delta_rule.py prefill --length 4000 --chunks 32 64 128
    python benchmarks/delta_rule.py decode --rows 1 8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import common
from qvl.kernels import attention, build
from qvl.kernels import delta_rule as dr
from qvl.kernels.library import library
from qvl.kv_cache import BLOCK

HK, HV, DK, DV, KERNEL = 16, 16, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV  # q, k and v through the convolution
ATTENTION = (8, 2, 256)  # the 2B full-attention layer's query heads, key/value heads, head size


def prompt(t: int, dtype: torch.dtype) -> dict:
    """One row's inputs of t tokens: the projections' qkv [T, C], the gates, weights and states."""
    return {"x": torch.randn(t, CHANNELS).to(dtype), "weight": (torch.randn(CHANNELS, KERNEL) * 0.5).to(dtype),
            "g": -torch.nn.functional.softplus(torch.randn(t, HV)) * 0.2, "beta": torch.rand(t, HV)}


def split(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's output [N, C] -> q, k [N, Hk, Dk], v [N, Hv, Dv] (views)."""
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], -1)
    return q.unflatten(-1, (HK, DK)), k.unflatten(-1, (HK, DK)), v.unflatten(-1, (HV, DV))


def layer(conv, rule, p: dict):
    """conv + delta rule of one prompt from zero states, as a layer runs them."""
    def run():
        conv_state = torch.zeros(CHANNELS, KERNEL - 1, dtype=p["x"].dtype)
        state = torch.zeros(HV, DK, DV)
        return rule(*split(conv(p["x"], p["weight"], conv_state)), p["g"], p["beta"], state, 0)
    return run


def attention_side(t: int) -> tuple[str, object]:
    """(name, call) of the full-attention layer's causal attention over a t-token prompt, as
    ops.cache_attention runs it: qvl_attention over the paged cache where the build takes the
    shape, else torch's SDPA on the gathered keys."""
    heads, kv_heads, d = ATTENTION
    blocks = -(-t // BLOCK)
    keys, values = (torch.randn(blocks, kv_heads, BLOCK, d).bfloat16() for _ in range(2))
    table, q = torch.randperm(blocks), torch.randn(t, heads, d).bfloat16()
    lib = library().lib
    if library().has(build.BF16) and attention.paged_attention(lib, q, keys, values, table, 0) is not None:
        return "qvl_attention", lambda: attention.paged_attention(lib, q, keys, values, table, 0)
    k, v = (x[table].transpose(0, 1).reshape(1, kv_heads, -1, d)[:, :, :t].contiguous() for x in (keys, values))
    return "SDPA (qvl_attention does not take this head size here)", lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=True)


def measure(sides: dict, args) -> dict[str, list[float]]:
    return common.alternate({name: lambda fn=fn: common.time_call(fn, args.repeat) for name, fn in sides.items()},
                            args.rounds)


def table(times: dict[str, list[float]], bases: list[str]) -> None:
    print("| side | ms | " + " | ".join(f"vs {b}" for b in bases) + " |")
    print("|---|---|" + "---|" * len(bases))
    for name, values in times.items():
        ratios = [f"{common.round_ratio(values, times[b]):.3f}x" for b in bases]
        print(f"| {name} | {common.spread([v * 1e3 for v in values], '{:.1f}')} | " + " | ".join(ratios) + " |")


def prefill(args) -> None:
    torch.manual_seed(0)
    lib = library().lib
    p = prompt(args.length, args.dtype)
    sides = {"torch reference": layer(dr.reference_causal_conv, dr.reference_gated_delta_rule, p)}
    for chunk in args.chunks:
        sides[f"qvl, chunk {chunk}"] = layer(
            lambda *a: dr.native_causal_conv(lib, *a),
            lambda *a, chunk=chunk: dr.native_gated_delta_rule(lib, *a, chunk=chunk), p)
    name, sides["attention"] = attention_side(args.length)
    times = measure(sides, args)
    print(f"\nprefill of {args.length} tokens, {str(args.dtype)[6:]}, {torch.get_num_threads()} threads "
          f"({library().describe()}); attention: the full-attention layer's, by {name}\n")
    table(times, ["torch reference", "attention"])
    state = torch.zeros(CHANNELS, KERNEL - 1, dtype=args.dtype)
    conv = {"conv, torch": lambda: dr.reference_causal_conv(p["x"], p["weight"], state.clone()),
            "conv, qvl": lambda: dr.native_causal_conv(lib, p["x"], p["weight"], state.clone())}
    print()
    table(measure(conv, args), ["conv, torch"])


def decode(args) -> None:
    torch.manual_seed(0)
    lib = library().lib
    for rows in args.rows:
        p = prompt(rows, args.dtype)
        weight, slots = p["weight"], torch.arange(rows) * 2  # every other slot of the pool
        states, conv_states = torch.randn(2 * rows, HV, DK, DV) * 0.1, torch.zeros(2 * rows, CHANNELS, KERNEL - 1,
                                                                                     dtype=args.dtype)

        def step(conv, rule):
            return lambda: rule(*split(conv(p["x"], weight, conv_states, slots)), p["g"], p["beta"], states, slots)

        sides = {"torch reference": step(dr.reference_causal_conv_step, dr.reference_gated_delta_step),
                 "qvl": step(lambda *a: dr.native_causal_conv_step(lib, *a),
                             lambda *a: dr.native_gated_delta_step(lib, *a))}
        print(f"\ndecode step of {rows} row(s), {str(args.dtype)[6:]}, {torch.get_num_threads()} threads\n")
        table(measure(sides, args), ["torch reference"])


def main() -> None:
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--rounds", type=int, default=5)
    shared.add_argument("--repeat", type=int, default=3, help="calls per side and round (their median counts)")
    shared.add_argument("--threads", type=int, default=2)
    shared.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    pre = modes.add_parser("prefill", parents=[shared])
    pre.add_argument("--length", type=int, default=4000)
    pre.add_argument("--chunks", type=int, nargs="+", default=[dr.CHUNK])
    dec = modes.add_parser("decode", parents=[shared])
    dec.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    if library().lib is None:
        raise SystemExit(f"no native kernels: {library().describe()}")
    prefill(args) if args.mode == "prefill" else decode(args)


if __name__ == "__main__":
    main()
