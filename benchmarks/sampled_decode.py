"""Decode speed with the checkpoint's own sampling (not greedy, as `qvl bench` measures), from
two checkouts, alternating, in one run: what the per-token sampler costs a user who keeps the
defaults (Qwen3-VL: temperature 0.7, top_k 20, top_p 0.8).

    git worktree add /work/wt-before <commit>
    python benchmarks/sampled_decode.py --before /work/wt-before --after . --model /work/ckpt/qvl-2b --rounds 5
    python benchmarks/sampled_decode.py ... --flags="--top-k 0 --top-p 0.8"   # other sampling, both sides

Each measurement is one `qvl ask --json` of --new-tokens tokens (EOS ignored) without an image;
prints decode ms/token per side (median, min-max) and the after/before ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ab_checkouts import alternate, qvl_in, spread


def run(checkout: Path, args) -> dict:
    out = qvl_in(checkout, ["ask", "--model", args.model, "--threads", str(args.threads), "--ignore-eos",
                            "--max-new-tokens", str(args.new_tokens), "--answer-cache", "0", "--prefix-cache-mb", "0",
                            "--json", *args.flags.split(), "Tell me a long story about the sea."])
    return {"decode_ms": json.loads(out.strip().splitlines()[-1])["timings"]["decode_ms_per_token"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--flags", default="", help="extra `qvl ask` flags for both sides (sampling)")
    args = p.parse_args()
    sides = {"before": args.before, "after": args.after}
    for checkout in sides.values():  # the first start of each side quantises and builds: not measured
        run(checkout, args)
    results = alternate(list(sides), args.rounds, lambda name: run(sides[name], args))
    print(f"\n{args.threads} threads, {args.rounds} alternating rounds, sampling flags: '{args.flags}'")
    for name in sides:
        print(f"{name}: decode {spread([r['decode_ms'] for r in results[name]])} ms/token")
    ratio = statistics.median(r["decode_ms"] for r in results["after"]) / \
        statistics.median(r["decode_ms"] for r in results["before"])
    print(f"after / before: {ratio:.3f}")


if __name__ == "__main__":
    main()
