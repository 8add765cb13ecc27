"""Time to first token of a larger size against llama.cpp on the same synthetic checkpoint
(issue 15's side by side): qvl's defaults (`qvl bench`, a 1920x1080 photo at the default 256
image tokens) and llama-mtmd-cli on a 1920x1080 photo with --image-max-tokens 256, the GGUF
and mmproj converted from the same checkpoint, alternating, model loading excluded.

    python benchmarks/family_ttft.py --model /work/ckpt/qvl-8b-8layers --gguf-dir /work/ckpt/gguf \\
        --gguf qvl-8b-8layers-Q8_0.gguf --mmproj mmproj-qvl-8b-f16.gguf --llama-bin /work/llama/build-native/bin

    python benchmarks/family_ttft.py --model /work/ckpt/qvl-30b-a3b-4layers --weights int4 \
        --gguf-dir /work/ckpt/gguf --gguf qvl-30b-a3b-4layers-Q4_K_M.gguf --mmproj mmproj-qvl-30b-a3b-f16.gguf \
        --llama-bin /work/llama/build-native/bin

Conversions: `convert_hf_to_gguf.py CKPT --outtype q8_0 --outfile DIR/qvl-8b-8layers-Q8_0.gguf` and
`convert_hf_to_gguf.py CKPT --mmproj --outtype f16 --outfile DIR/mmproj-qvl-8b-f16.gguf`; Q4_K_M:
`--outtype bf16`, then `llama-quantize BF16_FILE OUT Q4_K_M`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tiers import run_llama_ttft  # noqa: E402


def qvl_ttft(args) -> dict:
    out = subprocess.run([sys.executable, "-m", "qvl.cli", "bench", "--model", args.model, "--threads",
                          str(args.threads), "--weights", args.weights, "--image", "1920x1080", "--new-tokens", "1",
                          "--repeat", "2", "--json"],
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"ttft_ms": r["ttft_ms"], "vision_ms": r["vision_ms"], "image_tokens": r["image_tokens"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gguf-dir", required=True)
    p.add_argument("--gguf", required=True, help="the model file in --gguf-dir (Q8_0 beside int8, Q4_K_M beside int4)")
    p.add_argument("--weights", default="int8", help="qvl's weight format (default int8)")
    p.add_argument("--mmproj", required=True, help="the mmproj file in --gguf-dir")
    p.add_argument("--llama-bin", required=True, help="a llama.cpp build's bin folder (llama-mtmd-cli)")
    p.add_argument("--photo", default="/work/ckpt/photo-1920x1080.jpg")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    llama_args = argparse.Namespace(gguf=args.gguf_dir, mmproj=args.mmproj, threads=args.threads, photo=args.photo)
    runs: dict[str, list[dict]] = {"qvl": [], "llama.cpp": []}
    measure = {"qvl": lambda: qvl_ttft(args),
               "llama.cpp": lambda: run_llama_ttft(llama_args, args.llama_bin, "int8", args.gguf)}
    for r in range(args.rounds):
        for side in (["qvl", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "qvl"]):
            runs[side].append(measure[side]())
            print(f"round {r + 1} {side}: {runs[side][-1]}", flush=True)
    print(f"\n{args.threads} threads, {args.rounds} alternating rounds; medians (min-max)\n")
    print("| side | first token ms | vision ms | image tokens |\n|---|---|---|---|")
    for side, rows in runs.items():
        t, v = [x["ttft_ms"] for x in rows], [x["vision_ms"] for x in rows]
        print(f"| {side} | {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f}) | {statistics.median(v):.0f} | "
              f"{rows[0]['image_tokens']} |")
    ratio = [a["ttft_ms"] / b["ttft_ms"] for a, b in zip(runs["qvl"], runs["llama.cpp"])]
    print(f"\nqvl / llama.cpp first token, per round: {', '.join(f'{x:.2f}' for x in ratio)}; "
          f"median {statistics.median(ratio):.2f}")


if __name__ == "__main__":
    main()
