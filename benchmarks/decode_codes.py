"""How far the decode GEMV's activation codes move the next-token logits from bf16 weights: this
checkout's kernels against another checkout's (e.g. 16-bit codes per 128 columns before the
8-bit codes per 64 columns of section 41), on the same model in one process.

Every side decodes the same token sequences one token per step from position 0 (teacher
forcing: the tokens are fixed, so the rows never drift apart), `--rows` sequences together,
through `decode_step` (the one-call native step with the defaults: int8 weights, bf16 compute).
The reference is the same checkpoint loaded with bf16 weights (exact float products). Per side:
mean per-position cosine of the logits and top-1 agreement with the reference, and top-1
agreement between the two sides.

--smooth 0.2,0.5 adds, per migration strength alpha, the text layers smoothed data-free from
their norms (qvl.smoothing, as the vision tower is at load) before int8 quantisation
(int8_activations.quantize_in_place), decoded with both sides' kernels.

    git worktree add /work/wt-before <commit>
    python benchmarks/decode_codes.py --model /work/ckpt/qvl-2b-outliers --before /work/wt-before
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn.functional as F

from decode_rows import library_of
from int8_activations import quantize_in_place
from qvl.kernels import build
from qvl.kernels import library as library_module
from qvl.kernels.library import library
from qvl.engine import Engine, EngineOptions
from qvl.generate import decode_step, new_cache
from qvl.smoothing import smooth


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
    p.add_argument("--smooth", default="", help="comma-separated alphas: also the text layers smoothed data-free")
    args = p.parse_args()
    reference = Engine.load(EngineOptions(model=args.model, weights="bf16", threads=2))
    vocab = reference.model.cfg.text.vocab_size
    tokens = torch.randint(0, min(vocab, 150000), (args.rows, args.steps), generator=torch.Generator().manual_seed(args.seed))
    smoothed = {}
    for alpha in [float(a) for a in args.smooth.split(",") if a]:  # built before the float model's native layers exist
        model = copy.deepcopy(reference.model)
        smooth(model, alpha=alpha, text=True, vision=False)
        smoothed[f"smoothed, alpha {alpha}"] = quantize_in_place(model, False)
    with torch.inference_mode():
        ref = teacher_forced(reference.model, tokens)
    del reference
    engine = Engine.load(EngineOptions(model=args.model, threads=2))
    models = {"int8 weights (the defaults)": engine.model, **smoothed}
    chosen = library()
    sides = {"before": dataclasses.replace(chosen, lib=build.open_library(library_of(args.before, chosen.tier.name))),
             "after": chosen}
    print(f"tier {chosen.tier.name}; {args.rows} sequences x {args.steps} positions, teacher-forced decode steps; "
          f"before: {args.before}, after: this checkout\n")
    print("| model | side | logits cos vs bf16 weights | top-1 vs bf16 weights | top-1 vs the other side |")
    print("|---|---|---|---|---|")
    for label, model in models.items():
        logits = {}
        for side, k in sides.items():
            library_module._chosen[0] = k
            with torch.inference_mode():
                logits[side] = teacher_forced(model, tokens)
        library_module._chosen[0] = chosen
        other = {"before": "after", "after": "before"}
        for side, lg in logits.items():
            cos = F.cosine_similarity(lg, ref, dim=-1).mean().item()
            top = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
            agree = (lg.argmax(-1) == logits[other[side]].argmax(-1)).float().mean().item()
            print(f"| {label} | {side} | {cos:.5f} | {top:.3f} | {agree:.3f} |", flush=True)


if __name__ == "__main__":
    main()
