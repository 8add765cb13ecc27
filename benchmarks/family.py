"""Decode of the larger dense sizes against their floor (issue: the Qwen3-VL family), on
synthetic checkpoints at full width with fewer text layers (so they fit this disk and
memory; a decode step's bytes scale with the layers, so the ratio to the floor carries over).

    python benchmarks/family.py --presets 4b 8b --layers 8 --rounds 3
    python benchmarks/family.py --presets 8b --llama-bin /work/llama/build-native/bin --gguf-dir /work/ckpt/gguf

    python benchmarks/family.py --presets 30b-a3b --layers 4 --weights int4 --gguf-type Q4_K_M \
        --llama-bin /work/llama/build-native/bin --gguf-dir /work/ckpt/gguf

With --llama-bin, llama.cpp's llama-bench decodes the same checkpoint converted to GGUF
(`convert_hf_to_gguf.py CKPT --outtype q8_0 --outfile GGUF_DIR/qvl-P-Llayers-Q8_0.gguf`; Q4_K_M:
`--outtype bf16`, then `llama-quantize`) in the same rounds, and the qvl / llama.cpp ratio is printed.

Per preset: `qvl synth --preset P --layers L` (once, into --dir), then per round the read
bandwidth (compare.machine_rates: a streaming sum over 1 GiB in weight-sized pieces) and
`qvl bench --image none` in int8, alternating the order. The floor is what a decode step
reads (qvl.sizing: the text decoder's linears and the lm_head as qvl stores them) over that
round's bandwidth; printed per round, then medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from compare import machine_rates

from qvl.config import ModelConfig
from qvl.sizing import footprint


def bench(model: Path, threads: int, weights: str, new_tokens: int) -> float:
    out = subprocess.run([sys.executable, "-m", "qvl.cli", "bench", "--model", str(model), "--weights", weights,
                          "--threads", str(threads), "--image", "none", "--new-tokens", str(new_tokens),
                          "--repeat", "2", "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["decode_ms_per_token"]


def llama_decode(bin_dir: Path, gguf: Path, threads: int, new_tokens: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(new_tokens),
                          "-t", str(threads), "-r", "2", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return 1000.0 / json.loads(out)[0]["avg_ts"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["4b", "8b"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--weights", default="int8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dir", type=Path, default=Path("/work/ckpt"))
    p.add_argument("--llama-bin", type=Path, help="a llama.cpp build's bin folder (llama-bench)")
    p.add_argument("--gguf-dir", type=Path, help="where the GGUF conversions are")
    p.add_argument("--gguf-type", default="Q8_0", help="the GGUF's type, in its name qvl-P-Llayers-TYPE.gguf")
    args = p.parse_args()
    for preset in args.presets:
        model = args.dir / f"qvl-{preset}-{args.layers}layers"
        if not any(model.glob("model*.safetensors*")):
            subprocess.run([sys.executable, "-m", "qvl.cli", "synth", str(model), "--preset", preset,
                            "--layers", str(args.layers)], check=True)
        read = footprint(ModelConfig.from_file(model / "config.json"), args.weights).read_per_token
        bench(model, args.threads, args.weights, 4)  # the first start quantises and builds: not measured
        gguf = args.gguf_dir / f"{model.name}-{args.gguf_type}.gguf" if args.gguf_dir else None
        ratios, times, floors, llama = [], [], [], []
        for rnd in range(args.rounds):
            if rnd % 2 == 0:
                gb_s = machine_rates(args.threads)["read_gb_s"]
                ms = bench(model, args.threads, args.weights, args.new_tokens)
                if args.llama_bin:
                    llama.append(llama_decode(args.llama_bin, gguf, args.threads, args.new_tokens))
            else:
                if args.llama_bin:
                    llama.append(llama_decode(args.llama_bin, gguf, args.threads, args.new_tokens))
                ms = bench(model, args.threads, args.weights, args.new_tokens)
                gb_s = machine_rates(args.threads)["read_gb_s"]
            floor = read / (gb_s * 1e9) * 1000
            ratios.append(ms / floor)
            times.append(ms)
            floors.append(floor)
            print(f"{preset} round {rnd + 1}: {ms:.1f} ms/token, read {gb_s:.1f} GB/s, floor {floor:.1f} ms, "
                  f"{ms / floor:.2f}x floor" + (f", llama.cpp {args.gguf_type} {llama[-1]:.1f} ms/token" if llama else ""),
                  flush=True)

        def spread(values):
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

        print(f"{preset}, {args.layers} of its layers, {args.weights}: {read / 1e9:.2f} GB read per token; "
              f"decode {spread(times)} ms/token, floor {spread(floors)} ms, x floor {spread(ratios)}")
        if llama:
            print(f"llama.cpp {args.gguf_type} decode {spread(llama)} ms/token; qvl / llama.cpp "
                  f"{spread([q / l for q, l in zip(times, llama)])}")


if __name__ == "__main__":
    main()
