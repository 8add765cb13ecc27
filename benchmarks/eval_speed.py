"""`qvl eval` against `qvl batch` on the same items: what scoring costs over answering.

Draws N labelled demo items (`python -m qvl.demo data`), then, R rounds with the two sides'
order alternating, runs as subprocesses (the user's commands, load included):

- `qvl eval SET --model M` (the default path: its table on stdout), and
- `qvl batch SET.jsonl --out ROWS --model M` with the same questions, greedy, the same
  --batch-size and --max-new-tokens (a fresh output file each round: no resume).

Prints the seconds of each side (median and range) and the median of the rounds' eval / batch
ratios.

    python benchmarks/eval_speed.py [--model DIR] [--items 500] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common


def batch_jobs(labels: Path) -> Path:
    """The labelled set as a `qvl batch` JSONL (id, image, prompt), beside the labels."""
    jobs = labels.parent / "jobs.jsonl"
    with open(labels, encoding="utf-8") as src, open(jobs, "w", encoding="utf-8") as out:
        for line in src:
            row = json.loads(line)
            out.write(json.dumps({"id": row["id"], "image": row["image"], "prompt": row["question"]}) + "\n")
    return jobs


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: the shipped demo model)")
    p.add_argument("--items", type=int, default=500)
    p.add_argument("--seed", type=int, default=1, help="the demo set drawn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()
    if args.model is None:
        from qvl.demo import shipped

        args.model = str(shipped.folder())
    work = Path(tempfile.mkdtemp(prefix="qvl-eval-speed-"))
    subprocess.run([sys.executable, "-m", "qvl.demo", "data", "--out", str(work / "set"), "--seed", str(args.seed),
                    "--count", str(args.items)], check=True, stdout=subprocess.DEVNULL)
    jobs = batch_jobs(work / "set" / "labels.jsonl")
    common_flags = ["--model", args.model, "--threads", str(args.threads), "--batch-size", str(args.batch_size),
                    "--max-new-tokens", str(args.max_new_tokens)]
    qvl = [sys.executable, "-m", "qvl.cli"]
    runs = itertools.count()
    sides = {
        "qvl eval": lambda: timed([*qvl, "eval", str(work / "set"), *common_flags]),
        "qvl batch": lambda: timed([*qvl, "batch", str(jobs), "--out", str(work / f"rows-{next(runs)}.jsonl"),
                                    "--temperature", "0", *common_flags]),
    }
    sides["qvl batch"]()  # not timed: kernels built, files in the page cache
    results = common.alternate(sides, args.rounds, echo=True)
    print(f"\n{args.items} demo items (seed {args.seed}), {args.threads} threads, batch size {args.batch_size}, "
          f"{args.rounds} rounds\n")
    print("| command | seconds |\n|---|---|")
    for name, values in results.items():
        print(f"| {name} | {common.spread(values)} |")
    print(f"\nqvl eval / qvl batch: {common.round_ratio(results['qvl eval'], results['qvl batch']):.3f}x")


if __name__ == "__main__":
    main()
