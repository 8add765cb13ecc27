"""Process start -> ready to answer, with a warm page cache: a fresh Python process imports
qvl, loads the engine and answers one short text question (1 new token). Wall time from
spawning the process to the answer, median of --repeat runs per configuration.

    python benchmarks/startup.py --model /work/ckpt/qvl-2b
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = """
import json, resource, sys, time
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
engine = Engine.load(EngineOptions(model=sys.argv[1], weights=sys.argv[2], threads=2))
done = engine.generate(Request([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_new_tokens=1)))
print(json.dumps({"load_s": engine.load_s, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4"])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print("| weights | engine load s | process start → first answer s | peak RSS MB |\n|---|---|---|---|")
    for weights in args.weights:
        subprocess.run([sys.executable, "-c", CHILD, args.model, weights], check=True, capture_output=True)  # warm
        walls, loads, rss = [], [], []
        for _ in range(args.repeat):
            started = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, weights], check=True, capture_output=True,
                                 text=True)
            walls.append(time.perf_counter() - started)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            loads.append(r["load_s"])
            rss.append(r["rss_mb"])
        print(f"| {weights} | {statistics.median(loads):.2f} | {statistics.median(walls):.2f} | "
              f"{statistics.median(rss):.0f} |", flush=True)


if __name__ == "__main__":
    main()
