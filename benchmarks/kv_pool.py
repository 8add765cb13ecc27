"""Clients whose answers end long before their max_tokens, under one KV budget: a checkout
that reserves each request's prompt plus token cap (before the paged pool) against one that
hands out blocks as rows grow, alternating, each side in its own process.

    git worktree add /work/wt-before <commit before the pool>
    python benchmarks/kv_pool.py --before /work/wt-before --after . --model /work/ckpt/qvl-2b \
        --clients 8 --kv-cache-mb 640 --rounds 3

Each client asks a different short text question with max_tokens 2048 (what clients often
send) and its answer ends after 64 tokens (min_tokens 64 and a +100 bias on EOS: the random
checkpoint would otherwise never stop). Prints per side: wall time for all clients, aggregate
tokens/s, the most requests running at once, preemptions, failures, and the after/before
ratio of the wall times (medians over the rounds). The answer, prefix and image caches are off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_checkouts import alternate  # noqa: E402


def measure(args) -> dict:
    """In the side's own process: every client through the engine's scheduler at once."""
    import time

    from qvl.engine import Engine, EngineOptions, Request
    from qvl.sampling import SamplingParams
    from qvl.scheduler import Sequence
    from qvl.stream import Done

    engine = Engine.load(EngineOptions(model=args.model, threads=args.threads, kv_cache_mb=args.kv_cache_mb,
                                       vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0))
    eos = engine.defaults.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_new_tokens=args.max_tokens, min_tokens=args.answer_tokens,
                            logit_bias=((eos, 100.0),))
    requests = [Request([{"role": "user", "content": f"Client {i}: what is {i * 37} plus {i * 11}?"}], params)
                for i in range(args.clients)]
    done: dict[int, object] = {}
    started = time.perf_counter()
    for i, r in enumerate(requests):
        engine.scheduler.submit(Sequence(engine.parse(r), lambda e, i=i: done.__setitem__(i, e)
                                         if isinstance(e, (Done, BaseException)) else None))
    most = 0
    while len(done) < len(requests):
        engine.scheduler.step()
        most = max(most, len(engine.scheduler.running))
    wall = time.perf_counter() - started
    answers = [d for d in done.values() if isinstance(d, Done)]
    tokens = sum(len(d.token_ids) for d in answers)
    return {"wall_s": wall, "tokens_per_s": tokens / wall, "most_running": most,
            "preemptions": getattr(engine.scheduler, "preemptions", 0), "failed": len(requests) - len(answers),
            "tokens": tokens}


def run_side(checkout: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve() / "src")}
    argv = [sys.executable, __file__, "--worker", "--model", args.model, "--clients", str(args.clients),
            "--kv-cache-mb", str(args.kv_cache_mb), "--max-tokens", str(args.max_tokens),
            "--answer-tokens", str(args.answer_tokens), "--threads", str(args.threads)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path)
    p.add_argument("--after", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kv-cache-mb", type=float, default=640)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    sides = {"before": args.before, "after": args.after}
    results = alternate(list(sides), args.rounds, lambda name: run_side(sides[name], args))
    print(f"\n{args.clients} clients, max_tokens {args.max_tokens}, answers of {args.answer_tokens + 1} tokens, "
          f"--kv-cache-mb {args.kv_cache_mb:g}, {args.threads} threads, {args.rounds} alternating rounds; "
          "medians (min-max)\n")
    print("| side | wall s | tokens/s | most running at once | preemptions | failed |\n|---|---|---|---|---|---|")
    for name in sides:
        rows = results[name]
        cell = lambda k: f"{statistics.median(r[k] for r in rows):.1f} ({min(r[k] for r in rows):.1f}-"  # noqa: E731
        print(f"| {name} | {cell('wall_s')}{max(r['wall_s'] for r in rows):.1f}) | "
              f"{cell('tokens_per_s')}{max(r['tokens_per_s'] for r in rows):.1f}) | "
              f"{max(r['most_running'] for r in rows)} | {max(r['preemptions'] for r in rows)} | "
              f"{max(r['failed'] for r in rows)} |")
    wall = {n: statistics.median(r["wall_s"] for r in results[n]) for n in sides}
    print(f"\nafter / before wall time: {wall['after'] / wall['before']:.3f}")


if __name__ == "__main__":
    main()
