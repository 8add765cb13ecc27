"""`qvl batch` over a folder of mixed images from two checkouts of qvl, alternating, in one
run: items per minute before and after a change (each side in its own process, PYTHONPATH set
to its checkout's src/; the model's load time is measured and taken out).

    git worktree add /work/wt-before <commit>
    python benchmarks/batch_ab.py --before /work/wt-before --after . --model /work/ckpt/qvl-2b --images 64
    python benchmarks/batch_ab.py --before . --after . --after-flags="--batch-size 8" --model /work/ckpt/qvl-2b

The images are photo-like test cards of mixed sizes (from 320x240 to 1920x1080, at most the
default 256 image tokens each); answers are greedy, at most --new-tokens tokens (a random-weight
model hardly ever ends by itself), the default --batch-size; caches off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ab_checkouts import alternate, qvl_in  # benchmarks/ is the script's folder, first on sys.path

SIZES = [(320, 240), (640, 480), (1024, 768), (1920, 1080), (800, 1200), (1280, 720), (480, 640), (1600, 900)]


def write_images(folder: Path, count: int) -> None:
    from qvl.bench import synthetic_image

    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        synthetic_image(w, h, seed=i).save(folder / f"img{i:03d}.jpg", quality=90)


def run(checkout: Path, folder: Path, args, flags: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        started = time.perf_counter()
        qvl_in(checkout, ["batch", str(folder), "--out", str(out), "--model", args.model, "--threads",
                          str(args.threads), "--prompt", "Describe this image.", "--max-new-tokens",
                          str(args.new_tokens), "--temperature", "0", "--answer-cache", "0", "--prefix-cache-mb",
                          "0", "--vision-cache-mb", "0", *flags.split()])
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    errors = sum("error" in r for r in rows)
    load = load_time(checkout, args)
    return {"items": len(rows), "errors": errors, "wall_s": wall, "load_s": load,
            "items_per_min": len(rows) * 60 / (wall - load)}


def load_time(checkout: Path, args) -> float:
    """What starting qvl and loading the model costs that side (a 1-token `qvl bench` without an image)."""
    started = time.perf_counter()
    qvl_in(checkout, ["bench", "--model", args.model, "--threads", str(args.threads), "--image", "none",
                      "--new-tokens", "1", "--repeat", "1", "--json"], 1800)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--before-flags", default="", help="extra `qvl batch` flags for the before side")
    p.add_argument("--after-flags", default="", help="... and for the after side")
    args = p.parse_args()
    sides = {"before": args.before, "after": args.after}
    flags = {"before": args.before_flags, "after": args.after_flags}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        write_images(folder, args.images)
        results = alternate(list(sides), args.rounds, lambda name: run(sides[name], folder, args, flags[name]))
    print(f"\n{args.images} mixed images, {args.new_tokens} tokens each, {args.threads} threads, {args.rounds} "
          "alternating rounds; medians (min-max)\n")
    print("| side | items/min | wall s (load s) | error rows |\n|---|---|---|---|")
    for name, rows in results.items():
        ipm = [r["items_per_min"] for r in rows]
        print(f"| {name} | {statistics.median(ipm):.1f} ({min(ipm):.1f}-{max(ipm):.1f}) | "
              f"{statistics.median(r['wall_s'] for r in rows):.0f} ({statistics.median(r['load_s'] for r in rows):.0f})"
              f" | {sum(r['errors'] for r in rows)} |")
    ratio = statistics.median(r["items_per_min"] for r in results["after"]) / statistics.median(
        r["items_per_min"] for r in results["before"])
    print(f"\nafter / before: {ratio:.2f}× items per minute")


if __name__ == "__main__":
    main()
