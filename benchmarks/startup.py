"""Process start -> ready to answer, with a warm page cache: a fresh Python process imports
qvl and loads the engine (ready), then answers one short text question (1 new token; the
first pass over the weights also maps their pages). Seconds since the process was created,
median of --repeat runs per configuration.

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
started = float(sys.argv[3])  # the parent's clock just before it spawned this process
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
engine = Engine.load(EngineOptions(model=sys.argv[1], weights=sys.argv[2], threads=2))
ready = time.time() - started
done = engine.generate(Request([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_new_tokens=1)))
print(json.dumps({"load_s": engine.load_s, "ready_s": ready, "answer_s": time.time() - started,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4"])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print("| weights | engine load s | process start → ready s | process start → first answer s | peak RSS MB |\n"
          "|---|---|---|---|---|")
    for weights in args.weights:
        subprocess.run([sys.executable, "-c", CHILD, args.model, weights, str(time.time())], check=True,
                       capture_output=True)  # warms the page cache
        runs = []
        for _ in range(args.repeat):
            spawned = str(time.time())
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, weights, spawned], check=True,
                                 capture_output=True, text=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(f"| {weights} | {med['load_s']:.2f} | {med['ready_s']:.2f} | {med['answer_s']:.2f} | "
              f"{med['rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
