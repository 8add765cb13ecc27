"""What a change costs: one workload from two checkouts of qvl (or one checkout with and without
some flags), the sides alternating in one run. Each side runs in its own process with PYTHONPATH
set to its checkout's src/ (its native kernels are built into the shared cache under their own
key); each side's first start (quantising the weights, building the kernels) runs once before
the rounds and is not measured.

bench  `qvl bench` on a synthetic photo (--image): decode ms/token, time to first token, load
       time and peak RSS. --first-start: every run starts from an empty quantised-weights cache
       (the native kernels' cache is shared), so it quantises the bf16 file.
batch  `qvl batch` over --images photo-like test cards of mixed sizes (320x240 to 1920x1080, at
       most the default 256 image tokens each), greedy answers of at most --new-tokens tokens,
       caches off: items per minute, with the model's load time (a 1-token `qvl bench`) taken out.
ask    `qvl ask` of exactly --new-tokens tokens without an image, with the checkpoint's own
       sampling (Qwen3-VL: temperature 0.7, top_k 20, top_p 0.8) unless --flags say otherwise:
       decode ms/token, what the per-token sampler costs.

    git worktree add /work/wt-before <commit>
    python benchmarks/ab_checkouts.py --before /work/wt-before --after . --model /work/ckpt/qvl-2b --rounds 3
    python benchmarks/ab_checkouts.py --before . --after . --after-flags=--deterministic --model /work/ckpt/qvl-2b
    python benchmarks/ab_checkouts.py --workload batch --before /work/wt-before --after . --model /work/ckpt/qvl-2b
    python benchmarks/ab_checkouts.py --workload batch --before . --after . --after-flags="--batch-size 8" ...
    python benchmarks/ab_checkouts.py --workload ask --flags="--top-k 0" --before /work/wt-before --after . ...

Prints each round's figures, then per side their medians (min-max) and the after/before ratios
(the median of the rounds' own ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import common

SIZES = [(320, 240), (640, 480), (1024, 768), (1920, 1080), (800, 1200), (1280, 720), (480, 640), (1600, 900)]
NO_CACHES = ["--answer-cache", "0", "--prefix-cache-mb", "0", "--vision-cache-mb", "0"]


def thread_args(args) -> list[str]:
    """--threads N for both sides; none at 0 (qvl's default, which follows the machine's load)."""
    return ["--threads", str(args.threads)] if args.threads else []


def qvl_in(checkout: Path, argv: list[str], env: dict | None = None, timeout: float = 3600) -> str:
    """`python -m qvl.cli ARGV` with the checkout's src/ first on the path; its stdout."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(checkout.resolve() / "src")}
    done = common.run([sys.executable, "-m", "qvl.cli", *argv], timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"qvl {argv[0]} in {checkout} failed:\n{done.tail()}")
    return done.stdout


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def bench(checkout: Path, args, flags: list[str], warm: bool = False) -> dict:
    argv = ["bench", "--model", args.model, *thread_args(args), "--image", args.image,
            "--new-tokens", str(args.new_tokens), "--repeat", "2", "--json", *flags]
    if args.first_start:
        from qvl.paths import cache_root

        with tempfile.TemporaryDirectory(dir=cache_root()) as cache:
            (Path(cache) / "native").symlink_to(cache_root() / "native")
            r = last_json(qvl_in(checkout, argv, {"QVL_CACHE_DIR": cache}))
    else:
        r = last_json(qvl_in(checkout, argv))
    return {"decode ms/token": r["decode_ms_per_token"], "first token ms": r["ttft_ms"], "load s": r["load_s"],
            "peak RSS MB": r["peak_rss_mb"]}


def batch(checkout: Path, args, flags: list[str], warm: bool = False) -> dict:
    folder = args.folder / ("warm" if warm else "images")
    load = load_time(checkout, args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        started = time.perf_counter()
        qvl_in(checkout, ["batch", str(folder), "--out", str(out), "--model", args.model, *thread_args(args),
                          "--prompt", "Describe this image.", "--max-new-tokens",
                          str(args.new_tokens), "--temperature", "0", *NO_CACHES, *flags])
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {"items/min": len(rows) * 60 / (wall - load), "wall s": wall, "load s": load,
            "error rows": sum("error" in r for r in rows)}


def load_time(checkout: Path, args) -> float:
    """What starting qvl and loading the model costs that side (a 1-token `qvl bench` without an image)."""
    started = time.perf_counter()
    qvl_in(checkout, ["bench", "--model", args.model, *thread_args(args), "--image", "none",
                      "--new-tokens", "1", "--repeat", "1", "--json"])
    return time.perf_counter() - started


def ask(checkout: Path, args, flags: list[str], warm: bool = False) -> dict:
    out = qvl_in(checkout, ["ask", "--model", args.model, *thread_args(args), "--ignore-eos",
                            "--max-new-tokens", str(args.new_tokens), *NO_CACHES, "--json", *flags,
                            "Tell me a long story about the sea."])
    return {"decode ms/token": last_json(out)["timings"]["decode_ms_per_token"]}


WORKLOADS = {"bench": bench, "batch": batch, "ask": ask}


def write_images(folder: Path, count: int) -> None:
    """count photo-like test cards of mixed sizes, as JPEG files."""
    from qvl.bench import synthetic_image

    folder.mkdir(parents=True)
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        synthetic_image(w, h, seed=i).save(folder / f"img{i:03d}.jpg", quality=90)


def report(results: dict[str, list[dict]], args) -> None:
    keys = list(results["before"][0])
    print(f"\n{args.workload}, {args.threads or 'default'} threads, {args.rounds} alternating rounds; medians (min-max)\n")
    print(common.markdown_table(["side", *keys], [[side, *(common.spread([r[k] for r in rows], "{:.1f}")
                                                           for k in keys)] for side, rows in results.items()]))
    ratios = []
    for k in keys:
        after, before = ([r[k] for r in results[side]] for side in ("after", "before"))
        if all(before):
            ratios.append(f"{k} {common.round_ratio(after, before):.3f}")
    print("\nafter / before: " + ", ".join(ratios))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="bench")
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="0: qvl's default count, which follows the load")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--image", default="1920x1080", help="bench: the synthetic photo, WIDTHxHEIGHT or none")
    p.add_argument("--images", type=int, default=64, help="batch: how many test cards")
    p.add_argument("--first-start", action="store_true", help="bench: every run quantises into an empty cache")
    p.add_argument("--flags", default="", help="extra flags of the workload's qvl command for both sides")
    p.add_argument("--before-flags", default="", help="... for the before side only")
    p.add_argument("--after-flags", default="", help="... for the after side only")
    args = p.parse_args()
    sides = {"before": args.before, "after": args.after}
    flags = {name: (args.flags + " " + getattr(args, f"{name}_flags")).split() for name in sides}
    workload = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp:
        args.folder = Path(tmp)
        if args.workload == "batch":
            write_images(args.folder / "images", args.images)
            write_images(args.folder / "warm", 1)
        for name, checkout in sides.items():
            workload(checkout, args, flags[name], warm=True)
        results = common.alternate({name: lambda name=name: workload(sides[name], args, flags[name])
                                    for name in sides}, args.rounds, echo=True)
    report(results, args)


if __name__ == "__main__":
    main()
