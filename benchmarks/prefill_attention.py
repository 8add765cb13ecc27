"""Prefill's causal attention, one layer of the 2B decoder (16 query heads over 8 key/value heads
of 128) over a paged cache, per call: qvl's kernel (what `cache_attention` runs: AMX-BF16 tiles
where the CPU has them, else AVX512-BF16 dot products) against torch's SDPA over the same
positions gathered, alternating, medians (min-max) of --rounds; and each side's largest
difference from float32 SDPA.

    python benchmarks/prefill_attention.py --rounds 7
    python benchmarks/prefill_attention.py --rounds 7 --before /work/wt-before

--before CHECKOUT: also that checkout's kernel, built for the same tier from its sources.

--model CKPT --image-tokens N: instead, the whole prefill of the 1920x1080 photo's prompt in the
model (default engine; vision encoded once), with prefill's attention flipped between qvl's
kernel and torch's SDPA (`Kernels.flash_attention`) in one process, the sides alternating run by
run, so both see the same machine state (whole first tokens from two processes could not show a
few percent on a VM whose speed moves within minutes):

    python benchmarks/prefill_attention.py --model /work/ckpt/qvl-2b --image-tokens 256 --rounds 10

Shapes: a whole prompt of 280 and 1,030 tokens (the photo at 256 and 1024 image tokens) and
the last 64-token slice of the 1,030-token one (a slice beside generating rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from qvl.kernels import attention, build
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan
from qvl.kv_cache import BLOCK
from vision_attention import checkout_library, spread  # benchmarks/ is the script's folder

HEADS, KV_HEADS, D = 16, 8, 128


def pool(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool layer [blocks, KV_HEADS, BLOCK, D] holding one row's `length` positions in
    shuffled blocks, and its block table."""
    n = -(-length // BLOCK)
    keys, values = (torch.randn(n, KV_HEADS, BLOCK, D).bfloat16() for _ in range(2))
    return keys, values, torch.randperm(n)


def gathered(x: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[1, KV_HEADS, length, D] contiguous, as `KVCache.gather` gives SDPA."""
    return x[table].permute(1, 0, 2, 3).reshape(1, KV_HEADS, -1, D)[:, :, :length].contiguous()


def in_model(args) -> None:
    """The photo's prompt prefilled with prefill's attention on qvl's kernel and on SDPA, alternating."""
    from qvl.bench import synthetic_image
    from qvl.engine import Engine, EngineOptions, Request
    from qvl.generate import new_cache, prefill_slice
    from qvl.sampling import SamplingParams
    from qvl.stream import Timings

    engine = Engine.load(EngineOptions(model=args.model, threads=args.threads, answer_cache_entries=0,
                                       prefix_cache_mb=0, max_image_tokens=args.image_tokens))
    request = Request([{"role": "user", "content": [{"type": "image", "image": synthetic_image(1920, 1080, seed=0)},
                                                    {"type": "text", "text": "Describe this image."}]}],
                      SamplingParams(temperature=0, max_new_tokens=1))
    prompt = engine.prepare(engine.parse(request), Timings())
    ours = attention.paged_attention

    def prefill(side: str) -> float:
        attention.paged_attention = ours if side == "qvl" else (lambda *a, **kw: None)  # declined: SDPA runs
        cache = new_cache(engine.model, 1, len(prompt))
        with torch.inference_mode():
            started = time.perf_counter()
            prefill_slice(engine.model, cache, prompt, 0, len(prompt))
            return time.perf_counter() - started

    times: dict[str, list[float]] = {"qvl": [], "sdpa": []}
    for r in range(args.rounds):
        for side in (("qvl", "sdpa") if r % 2 == 0 else ("sdpa", "qvl")):
            times[side].append(prefill(side))
    attention.paged_attention = ours
    print(f"{len(prompt)} prompt tokens; prefill ms, {args.rounds} alternating rounds: qvl's kernel "
          f"{spread(times['qvl'])}, SDPA {spread(times['sdpa'])}; qvl / SDPA "
          f"{statistics.median(times['qvl']) / statistics.median(times['sdpa']):.3f}, per round "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(times["qvl"], times["sdpa"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--before", help="a checkout whose kernel (same tier) runs beside this one's")
    p.add_argument("--model", help="the whole prefill in this checkpoint instead (see above)")
    p.add_argument("--image-tokens", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        return in_model(args)
    lib = library().lib
    before = checkout_library(args.before) if args.before else None
    print(f"{default_plan(torch.bfloat16).prefill_attention} / AMX tiles: {bool(lib.features & build.AMX_INT8)}; "
          f"{args.threads} threads\n")
    print("| prompt tokens (queries) | SDPA ms | qvl ms | qvl / SDPA | max diff SDPA, qvl (vs float32) |"
          + (" before ms | qvl / before |" if before else "") + "\n|---|---|---|---|---|" + ("---|---|" if before else ""))
    torch.manual_seed(0)
    for length, queries in ((280, 280), (1030, 1030), (1030, 64)):
        start = length - queries
        keys, values, table = pool(length)
        q = (torch.randn(queries, HEADS, D) * 2).bfloat16()
        k, v = gathered(keys, table, length), gathered(values, table, length)
        mask = (torch.arange(length)[None, :] <= torch.arange(start, length)[:, None])[None, None]
        qt = q.transpose(0, 1)[None]

        def sdpa(dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(qt.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                                  enable_gqa=True)[0].transpose(0, 1)

        sides = {"sdpa": sdpa, "qvl": lambda: attention.paged_attention(lib, q, keys, values, table, start)}
        if before:
            sides["before"] = lambda: attention.paged_attention(before, q, keys, values, table, start)
        times: dict[str, list[float]] = {name: [] for name in sides}
        with torch.inference_mode():
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    started = time.perf_counter()
                    sides[name]()
                    times[name].append(time.perf_counter() - started)
            ref = sdpa(torch.float32)
            diffs = [(sides[name]().float() - ref).abs().max().item() for name in ("sdpa", "qvl")]
        row = (f"| {length} ({queries}) | {spread(times['sdpa'])} | {spread(times['qvl'])} | "
               f"{statistics.median(times['qvl']) / statistics.median(times['sdpa']):.2f} | "
               f"{diffs[0]:.4f}, {diffs[1]:.4f} |")
        if before:
            row += f" {spread(times['before'])} | {statistics.median(times['qvl']) / statistics.median(times['before']):.2f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
