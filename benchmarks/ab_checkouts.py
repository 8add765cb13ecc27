"""`qvl bench` from two checkouts of qvl (or one checkout with and without some flags),
alternating, in one run: did a change make one stream slower? Each side runs in its own
process with PYTHONPATH set to its checkout's src/ (its own native kernels are built into the
shared cache under their own key).

    git worktree add /work/wt-before <commit>
    python benchmarks/ab_checkouts.py --before /work/wt-before --after . --model /work/ckpt/qvl-2b --rounds 3
    python benchmarks/ab_checkouts.py --before . --after . --after-flags=--deterministic --model /work/ckpt/qvl-2b
    python benchmarks/ab_checkouts.py --before /work/wt-before --after . --model /work/ckpt/qvl-2b --first-start

Prints decode ms/token, time to first token, load time and peak RSS per side (medians and
min-max) and the after/before ratios. --first-start: every run starts from an empty
quantised-weights cache (the native kernels' cache is shared), so it quantises the bf16 file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def qvl_in(checkout: Path, argv: list[str], timeout_s: float = 3600, env: dict | None = None) -> str:
    """`python -m qvl.cli ARGV` with the checkout's src/ first on the path; its stdout."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(checkout.resolve() / "src")}
    done = subprocess.run([sys.executable, "-m", "qvl.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"qvl {argv[0]} in {checkout} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def alternate(sides: list[str], rounds: int, measure) -> dict[str, list[dict]]:
    """measure(side) for every side in every round, the order reversed every other round."""
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for rnd in range(rounds):
        for name in sides if rnd % 2 == 0 else sides[::-1]:
            results[name].append(measure(name))
            print(f"round {rnd + 1} {name}: {results[name][-1]}", flush=True)
    return results


def run(checkout: Path, args, flags: str = "") -> dict:
    argv = ["bench", "--model", args.model, "--threads", str(args.threads), "--image", args.image,
            "--new-tokens", str(args.new_tokens), "--repeat", "2", "--json", *flags.split()]
    if args.first_start:
        from qvl.paths import cache_root

        with tempfile.TemporaryDirectory(dir=cache_root()) as cache:
            (Path(cache) / "native").symlink_to(cache_root() / "native")
            out = qvl_in(checkout, argv, 1800, {"QVL_CACHE_DIR": cache})
    else:
        out = qvl_in(checkout, argv, 1800)
    r = json.loads(out.strip().splitlines()[-1])
    return {"decode_ms": r["decode_ms_per_token"], "ttft_ms": r["ttft_ms"], "load_s": r["load_s"],
            "rss_mb": r["peak_rss_mb"]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image", default="1920x1080")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--before-flags", default="", help="extra `qvl bench` flags for the before side")
    p.add_argument("--after-flags", default="", help="... and for the after side")
    p.add_argument("--first-start", action="store_true", help="every run quantises into an empty cache")
    args = p.parse_args()
    sides = {"before": args.before, "after": args.after}
    flags = {"before": args.before_flags, "after": args.after_flags}
    for name, checkout in sides.items():  # the first start of each side quantises and builds: not measured
        run(checkout, args, flags[name])
    results = alternate(list(sides), args.rounds, lambda name: run(sides[name], args, flags[name]))
    print(f"\n{args.threads} threads, {args.rounds} alternating rounds; medians (min-max)\n")
    keys = ("decode_ms", "ttft_ms", "load_s", "rss_mb")
    print("| side | decode ms/token | first token ms | load s | peak RSS MB |\n|---|---|---|---|---|")
    for name in sides:
        rows = results[name]
        print(f"| {name} | " + " | ".join(spread([r[k] for r in rows]) for k in keys) + " |")
    ratio = {k: statistics.median(r[k] for r in results["after"]) / statistics.median(r[k] for r in results["before"])
             for k in keys}
    print(f"\nafter / before: decode {ratio['decode_ms']:.3f}, first token {ratio['ttft_ms']:.3f}, "
          f"load {ratio['load_s']:.3f}, peak RSS {ratio['rss_mb']:.3f}")


if __name__ == "__main__":
    main()
