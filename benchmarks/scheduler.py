"""Continuous batching: what the scheduler gives several clients at once, measured as ratios
against one stream in the same run (2B synthetic checkpoint, default int8, 2 threads).

    python benchmarks/scheduler.py --model /work/ckpt/qvl-2b --rounds 3

1. Decode throughput with 1, 4 and 8 concurrent streams (text prompts, greedy, 64 tokens):
   each stream's median inter-token time, and the aggregate tokens/s against one stream's.
   The orders alternate between rounds (1, 4, 8 then 8, 4, 1).
2. Admission: 4 streams decoding when a 1920x1080 photo at the default budget arrives: the
   longest and the 99th-percentile gap between two tokens of the running streams while it is
   encoded and prefilled.
3. 16 clients (8 with a photo, 8 text only, 128 tokens each): wall time submitted together
   against the same requests one after another (--mixed-rounds N: N rounds, the order of the
   two alternating; --only-mixed: nothing else).

Besides the medians, each round's own ratios of 4 and 8 streams to one (measured back to back)
are printed: on a VM whose speed moves between runs, those are the comparable ones.

Answer, prefix and image caches are off: every request is computed. Requests go straight to
the engine's scheduler (what `qvl serve`'s worker thread drives), so HTTP is not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common
from qvl.bench import synthetic_image
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
from qvl.scheduler import DEFAULT_MAX_BATCH, Sequence
from qvl.stream import Done

F1 = "{:.1f}"  # milliseconds, seconds and tokens/s in the tables


def text_request(i: int, tokens: int) -> Request:
    return Request([{"role": "user", "content": f"Client {i}: tell me a long story about the number {i * 37}."}],
                   SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True))


def image_request(i: int, tokens: int) -> Request:
    image = synthetic_image(1920, 1080, seed=100 + i)
    return Request([{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": "Describe this image in detail."}]}],
                   SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True))


def run(engine: Engine, requests: list[Request], stagger: dict[int, int] | None = None) -> list[Done]:
    """Submit (request i after stagger[i] steps, else at once), step until all are done;
    each Done's timings hold its own clock."""
    parsed = [engine.parse(r) for r in requests]
    done: dict[int, Done] = {}
    stagger = stagger or {}

    def emit(i):
        return lambda e: done.__setitem__(i, e) if isinstance(e, (Done, BaseException)) else None

    steps = 0
    pending = {i: p for i, p in enumerate(parsed)}
    while len(done) < len(parsed):
        for i in [i for i in pending if stagger.get(i, 0) <= steps]:
            engine.scheduler.submit(Sequence(pending.pop(i), emit(i)))
        engine.scheduler.step()
        steps += 1
    for i, d in done.items():
        if isinstance(d, BaseException):
            raise RuntimeError(f"request {i} failed") from d
    return [done[i] for i in range(len(parsed))]


def throughput(engine: Engine, streams: int, tokens: int) -> dict:
    dones = run(engine, [text_request(i, tokens) for i in range(streams)])
    gaps = [statistics.median(d.timings.decode_ms[8:]) for d in dones]  # steady state: all are decoding
    return {"streams": streams, "inter_token_ms": statistics.median(gaps), "tokens_per_s": streams * 1000 / statistics.median(gaps)}


def admission(engine: Engine, tokens: int) -> dict:
    """4 text streams; the photo arrives at step 6, when all of them are decoding."""
    requests = [text_request(i, tokens) for i in range(4)] + [image_request(0, 8)]
    started = time.perf_counter()
    dones = run(engine, requests, stagger={4: 6})
    gaps = sorted(g for d in dones[:4] for g in d.timings.decode_ms)
    return {"max_gap_ms": gaps[-1], "p99_gap_ms": gaps[int(0.99 * (len(gaps) - 1))],
            "median_gap_ms": statistics.median(gaps), "photo_ttft_ms": dones[4].timings.ttft_ms,
            "wall_s": time.perf_counter() - started}


def mixed(engine: Engine, tokens: int, together_first: bool = True) -> dict:
    requests = [image_request(i, tokens) if i % 2 == 0 else text_request(i, tokens) for i in range(16)]

    def together() -> float:
        started = time.perf_counter()
        run(engine, requests)
        return time.perf_counter() - started

    def one_by_one() -> float:
        started = time.perf_counter()
        for r in requests:
            run(engine, [r])
        return time.perf_counter() - started

    if together_first:
        t = together()
        a = one_by_one()
    else:
        a = one_by_one()
        t = together()
    return {"together_s": t, "one_by_one_s": a, "ratio": t / a}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--mixed-rounds", type=int, default=1,
                   help="rounds of the 16-client figure (each about 2.5 min), the order alternating")
    p.add_argument("--only-mixed", action="store_true", help="only the 16-client figure")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="the scheduler's rows (qvl's default)")
    p.add_argument("--out", help="also write the raw results here (JSON)")
    args = p.parse_args()
    engine = Engine.load(EngineOptions(model=args.model, threads=args.threads, max_batch=args.max_batch,
                                       answer_cache_entries=0, prefix_cache_mb=0, vision_cache_mb=0))
    engine.warm_up()
    results: dict[str, list] = {}
    for rnd in range(0 if args.only_mixed else args.rounds):
        order = [1, 4, 8] if rnd % 2 == 0 else [8, 4, 1]
        for n in order:
            results.setdefault(f"streams{n}", []).append(throughput(engine, n, args.tokens))
            print(f"round {rnd + 1}: {results[f'streams{n}'][-1]}", flush=True)
        results.setdefault("admission", []).append(admission(engine, 4 * args.tokens))
        print(f"round {rnd + 1}: admission {results['admission'][-1]}", flush=True)
    if not args.skip_mixed:
        for rnd in range(args.mixed_rounds):
            results.setdefault("mixed", []).append(mixed(engine, 128, together_first=rnd % 2 == 0))
            print(f"mixed round {rnd + 1}: {results['mixed'][-1]}", flush=True)
    report(results, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def report(results: dict, args) -> None:
    print(f"\nthe scheduler's rows: --max-batch {args.max_batch}")
    if "streams1" in results:
        report_streams(results, args)
    if "mixed" in results:
        report_mixed(results["mixed"])


def report_streams(results: dict, args) -> None:
    print(f"\n{args.threads} threads, {args.rounds} alternating rounds; medians (min-max)\n")
    print("| streams | inter-token ms per stream | vs one stream | aggregate tokens/s | vs one stream |")
    print("|---|---|---|---|---|")
    one = [r["tokens_per_s"] for r in results["streams1"]]
    one_gap = [r["inter_token_ms"] for r in results["streams1"]]
    for n in (1, 4, 8):
        rows = results[f"streams{n}"]
        gaps, tps = [r["inter_token_ms"] for r in rows], [r["tokens_per_s"] for r in rows]
        print(f"| {n} | {common.spread(gaps, F1)} | {statistics.median(gaps) / statistics.median(one_gap):.2f}× | "
              f"{common.spread(tps, F1)} |"
              f" {statistics.median(tps) / statistics.median(one):.2f}× |")
    # each round measured 1, 4 and 8 streams back to back: its own ratios are the ones this VM's
    # speed swings between runs do not move
    for n in (4, 8):
        rounds = zip(results[f"streams{n}"], results["streams1"])
        pairs = [(r["tokens_per_s"] / o["tokens_per_s"], r["inter_token_ms"] / o["inter_token_ms"]) for r, o in rounds]
        print(f"\n{n} streams against one, per round: aggregate {', '.join(f'{a:.2f}' for a, _ in pairs)}× "
              f"(median {statistics.median(a for a, _ in pairs):.2f}×); inter-token "
              f"{', '.join(f'{g:.2f}' for _, g in pairs)}× (median {statistics.median(g for _, g in pairs):.2f}×)")
    adm = results["admission"]
    print("\n| while a 1920×1080 photo is admitted | ms |\n|---|---|")
    for key in ("median_gap_ms", "p99_gap_ms", "max_gap_ms", "photo_ttft_ms"):
        print(f"| {key} | {common.spread([r[key] for r in adm], '{:.0f}')} |")


def report_mixed(m: list[dict]) -> None:
    ratios = ", ".join(f"{r['ratio']:.2f}" for r in m)
    print(f"\n16 clients (8 photo, 8 text, 128 tokens), {len(m)} round(s), the order alternating: together "
          f"{common.spread([r['together_s'] for r in m], F1)} s, one by one "
          f"{common.spread([r['one_by_one_s'] for r in m], F1)} s; "
          f"per round {ratios}× (median {statistics.median(r['ratio'] for r in m):.2f}×)")


if __name__ == "__main__":
    main()
