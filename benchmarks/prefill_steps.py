"""Prompt tokens per prefill step for a request running alone (scheduler.PREFILL_TOKENS_ALONE),
A/B in one run: a 30 s 1280x720 clip's first token (1,114 prompt tokens, the 2B int8 default
path, caches off), fresh processes, the sides alternating, 3 rounds.

    python benchmarks/prefill_steps.py   # the clip: benchmarks/video.py writes it into /work/ckpt/clips
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

WORKER = r'''
import sys, time
import qvl.scheduler as scheduler
scheduler.PREFILL_TOKENS_ALONE = int(sys.argv[1])
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
engine = Engine.load(EngineOptions(model=sys.argv[2], threads=2, vision_cache_mb=0, prefix_cache_mb=0,
                                   answer_cache_entries=0, clip_cache_mb=0))
engine.warm_up()
request = Request([{"role": "user", "content": [{"type": "video", "video": sys.argv[3]},
                                                {"type": "text", "text": "Describe this clip."}]}],
                  SamplingParams(temperature=0, max_new_tokens=1))
started = time.perf_counter()
done = engine.generate(request)
print(time.perf_counter() - started, done.timings.prefill_ms / 1000)
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/work/ckpt/qvl-2b")
    p.add_argument("--clip", default="/work/ckpt/clips/synthetic-1280x720-30fps-30s.mp4")
    p.add_argument("--steps", type=int, nargs=2, default=[512, 2048])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    results: dict[int, list[tuple[float, float]]] = {s: [] for s in args.steps}
    for rnd in range(args.rounds):
        for step in (args.steps if rnd % 2 == 0 else args.steps[::-1]):
            out = subprocess.run([sys.executable, "-c", WORKER, str(step), args.model, args.clip],
                                 capture_output=True, text=True, check=True).stdout.split()
            results[step].append((float(out[0]), float(out[1])))
            print(f"round {rnd + 1}, {step}-token steps: TTFT {out[0][:5]} s, prefill {out[1][:5]} s", flush=True)
    for step, values in results.items():
        ttft, prefill = [v[0] for v in values], [v[1] for v in values]
        print(f"{step}-token steps: TTFT {statistics.median(ttft):.2f} s ({min(ttft):.2f}-{max(ttft):.2f}), "
              f"prefill {statistics.median(prefill):.2f} s ({min(prefill):.2f}-{max(prefill):.2f})")


if __name__ == "__main__":
    main()
