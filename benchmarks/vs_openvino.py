"""qvl's time to first token against OpenVINO GenAI's on the same photo and image budget, the
two sides alternating within each round (each in its own process; model loading excluded).

qvl: `qvl bench` with its defaults (int8 weights) on a synthetic 1920x1080 photo; OpenVINO:
benchmarks/openvino_ttft.py in its own virtualenv (see its docstring for the install and the
optimum-cli int8 export) on a 1920x1080 photo, resized the same way (256 -> 252 image tokens).
Timings do not depend on the picture (random weights), only on its grid, which both check.

    python benchmarks/vs_openvino.py --model /work/ckpt/qvl-2b --ov-model /work/ov-2b-int8 \
        --ov-python /work/ov-venv/bin/python --image-tokens 256,1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run_qvl(args, tokens: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "qvl.cli", "bench", "--model", args.model, "--threads", str(args.threads),
           "--image", "1920x1080", "--max-image-tokens", str(tokens), "--new-tokens", "1", "--repeat", "2",
           "--json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"qvl bench failed:\n{done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {"ttft_ms": r["ttft_ms"], "vision_ms": r["vision_ms"], "prefill_ms": r["prefill_ms"],
            "image_tokens": r["image_tokens"]}


def run_openvino(args, tokens: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [args.ov_python, os.path.join(HERE, "openvino_ttft.py"), "--model", args.ov_model, "--image-tokens",
               str(tokens), "--rounds", "2", "--threads", str(args.threads), "--out", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"openvino_ttft.py failed:\n{done.stderr[-2000:]}")
        r = json.load(open(out.name))["budgets"][0]
    # (its "vision encoding" metric covers the patch embedding only: the vision blocks run in the
    # vision_embeddings_merger model, inside the rest of the first token)
    return {"ttft_ms": statistics.median(r["ttft_ms"]), "vision_ms": statistics.median(r["vision_ms"]),
            "image_tokens": r["measured_image_tokens"]}


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--ov-model", required=True, help="the optimum-cli export (int8 weights)")
    p.add_argument("--ov-python", required=True, help="the python of the OpenVINO virtualenv")
    p.add_argument("--image-tokens", default="256,1024")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--qvl-extra", default="", help="extra `qvl bench` options for a second qvl side, e.g. "
                   "'--int8-activations all'")
    args = p.parse_args()
    sides = {"qvl": lambda t: run_qvl(args, t, []), "OpenVINO": lambda t: run_openvino(args, t)}
    if args.qvl_extra:
        sides[f"qvl {args.qvl_extra}"] = lambda t: run_qvl(args, t, args.qvl_extra.split())
    budgets = [int(t) for t in args.image_tokens.split(",")]
    results = {(s, t): [] for s in sides for t in budgets}
    for rnd in range(args.rounds):
        for tokens in budgets:
            for side in (list(sides) if rnd % 2 == 0 else list(sides)[::-1]):
                results[(side, tokens)].append(sides[side](tokens))
                print(f"round {rnd + 1}, {tokens} tokens, {side}: {results[(side, tokens)][-1]}", flush=True)
    print(f"\n{args.threads} threads, {args.rounds} alternating rounds; ms, medians (min-max)\n")
    print("| budget | side | image tokens | first token ms | vision ms | vs OpenVINO |\n|---|---|---|---|---|---|")
    for tokens in budgets:
        ov = statistics.median(r["ttft_ms"] for r in results[("OpenVINO", tokens)])
        for side in sides:
            rows = results[(side, tokens)]
            ttft = [r["ttft_ms"] for r in rows]
            print(f"| {tokens} | {side} | {rows[0]['image_tokens']} | {spread(ttft)} | "
                  f"{spread([r['vision_ms'] for r in rows])} | {statistics.median(ttft) / ov:.2f}× |")


if __name__ == "__main__":
    main()
