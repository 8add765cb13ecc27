"""How far the decode GEMV's activation codes move the next-token logits from bf16 weights: this
checkout's kernels against another checkout's (e.g. 16-bit codes per 128 columns before the
8-bit codes per 64 columns of section 41), on the same model in one process.

Every side decodes the same token sequences one token per step from position 0 (teacher
forcing: the tokens are fixed, so the rows never drift apart), `--rows` sequences together,
through `decode_step` (the one-call native step with the defaults: int8 weights, bf16 compute).
The reference is the same checkpoint loaded with bf16 weights (exact float products). Per side:
mean per-position cosine of the logits and top-1 agreement with the reference, and top-1
agreement between the two sides.

    git worktree add /work/wt-before <commit>
    python benchmarks/decode_codes.py --model /work/ckpt/qvl-2b-outliers --before /work/wt-before
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from decode_rows import library_of
from qvl import dispatch, native
from qvl.engine import Engine, EngineOptions
from qvl.generate import decode_step, new_cache


def teacher_forced(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> logits [B, T, V] float32, one decode step per position."""
    rows, steps = tokens.shape
    cache = new_cache(model, rows, steps + 1)
    out = []
    for t in range(steps):
        pos = torch.full((rows,), t)
        out.append(decode_step(model, cache, tokens[:, t], pos, pos).float())
    return torch.stack(out, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--before", required=True, help="another checkout (its root) whose kernels to compare")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, threads=2))
    vocab = engine.model.cfg.text.vocab_size
    tokens = torch.randint(0, min(vocab, 150000), (args.rows, args.steps), generator=torch.Generator().manual_seed(args.seed))
    chosen = dispatch.kernels()
    sides = {"before": dataclasses.replace(chosen, lib=native.open_library(library_of(args.before, chosen.tier.name))),
             "after": chosen}
    logits = {}
    for side, k in sides.items():
        dispatch._chosen[0] = k
        with torch.inference_mode():
            logits[side] = teacher_forced(engine.model, tokens)
    dispatch._chosen[0] = chosen
    del engine
    reference = Engine.load(EngineOptions(model=args.model, weights="bf16", threads=2))
    with torch.inference_mode():
        ref = teacher_forced(reference.model, tokens)
    print(f"tier {chosen.tier.name}; {args.rows} sequences x {args.steps} positions, teacher-forced decode steps; "
          f"before: {args.before}, after: this checkout\n")
    print("| side | logits cos vs bf16 weights | top-1 vs bf16 weights | top-1 vs the other side |")
    print("|---|---|---|---|")
    other = {"before": "after", "after": "before"}
    for side, lg in logits.items():
        cos = F.cosine_similarity(lg, ref, dim=-1).mean().item()
        top = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
        agree = (lg.argmax(-1) == logits[other[side]].argmax(-1)).float().mean().item()
        print(f"| {side} | {cos:.5f} | {top:.3f} | {agree:.3f} |")


if __name__ == "__main__":
    main()
