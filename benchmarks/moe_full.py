"""The full 48-layer Qwen3-VL-30B-A3B in int4 on this machine (issue 15): written by
`qvl synth --weights int4 --vision-int8` (no bf16 file), then started and asked about a
1920x1080 photo in fresh processes: load time, first token, decode ms/token against the
floor (what a step reads over the round's read bandwidth), and the process's peak RSS.

    python benchmarks/moe_full.py --model /work/ckpt/qvl-30b-a3b --rounds 3

The synthetic checkpoint is written once if --model has none (its time and the writer's
peak RSS are printed). Memory is the point here; there is no second side to alternate with.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare import machine_rates

from qvl.config import ModelConfig
from qvl.sizing import footprint


def synth(model: Path) -> None:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qvl.cli", "synth", str(model), "--preset", "30b-a3b", "--weights", "int4",
                    "--vision-int8"], check=True)
    rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    size = sum(f.stat().st_size for f in model.glob("model*.safetensors"))
    print(f"synth: {time.perf_counter() - started:.0f} s, {size / 1e9:.1f} GB of weights, writer's peak RSS "
          f"{rss_gb:.1f} GB", flush=True)


def bench(model: Path, threads: int, new_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "qvl.cli", "bench", "--model", str(model), "--threads", str(threads),
                          "--image", "1920x1080", "--new-tokens", str(new_tokens), "--repeat", "1", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/work/ckpt/qvl-30b-a3b"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    if not any(args.model.glob("model*.safetensors*")):
        synth(args.model)
    read = footprint(ModelConfig.from_file(args.model / "config.json"), "int4", vision_int8=True).read_per_token
    rows = []
    for rnd in range(args.rounds):
        r = bench(args.model, args.threads, args.new_tokens)
        gb_s = machine_rates(args.threads)["read_gb_s"]
        r["floor_ms"] = read / (gb_s * 1e9) * 1000
        rows.append(r)
        print(f"round {rnd + 1}: load {r['load_s']:.1f} s, first token {r['ttft_ms']:.0f} ms "
              f"({r['image_tokens']} image tokens), decode {r['decode_ms_per_token']:.1f} ms/token, "
              f"floor {r['floor_ms']:.1f} ms ({gb_s:.1f} GB/s), peak RSS {r['peak_rss_mb'] / 1024:.2f} GB", flush=True)

    def spread(key: str, scale: float = 1.0) -> str:
        values = [r[key] * scale for r in rows]
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    ratios = [r["decode_ms_per_token"] / r["floor_ms"] for r in rows]
    print(f"\n48-layer 30B-A3B int4, {args.threads} threads, {args.rounds} rounds; medians (min-max)")
    print(f"read per token {read / 1e9:.2f} GB; load {spread('load_s')} s; first token {spread('ttft_ms')} ms; "
          f"decode {spread('decode_ms_per_token')} ms/token; x floor {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}); peak RSS {spread('peak_rss_mb', 1 / 1024)} GB")


if __name__ == "__main__":
    main()
