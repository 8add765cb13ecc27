"""qvl on each kernel tier of this machine, emulating older CPUs, side by side with llama.cpp
built for the same tier, and the vision tower against transformers with torch held to the tier.

    python benchmarks/tiers.py --model /work/ckpt/qvl-2b --gguf /work/ckpt/gguf \
        --llama avx512=/work/peers/llama/build/bin --llama avx2=/work/peers/llama/build-avx2/bin \
        --rounds 3 --variants --out tiers.json

A tier is emulated with QVL_ISA (qvl's kernels) plus torch's own switches: ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS (MKL runs the float32 GEMMs), so that every
product torch runs (prefill GEMMs, SDPA, int8 GEMMs) is held to the tier too, and --dtype auto
picks float32 where the tier has no bf16 products. --llama TIER=BIN_DIR: a llama.cpp build for
that tier (benchmarks/README.md builds the native one; GGML_NATIVE=OFF with the tier's GGML_*
switches builds the others); --gguf: the folder holding qvl-2b-Q8_0.gguf, qvl-2b-Q4_0.gguf and
the mmproj. --variants adds the int8 model's first token without integer activations (a bf16
vision tower, float products) and with int8 x int8 products everywhere, on the float32 tiers.

Each measurement runs in its own process (peak RSS is per process); the sides alternate
within each round and the tables give medians with the spread (min-max) over the rounds.
Workload: a 1920x1080 photo at the default budget (256 image tokens), the bench prompt, then
32 decoded tokens; llama.cpp: llama-bench -n 32 for decoding, llama-mtmd-cli -n 1 on the same
photo with --image-max-tokens 256 (252 image tokens, as qvl) for the first token: its "prompt
eval time", which includes the image encode.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import common

GGUF = {"int8": "qvl-2b-Q8_0.gguf", "int4": "qvl-2b-Q4_0.gguf"}
PROMPT = "Describe this image in detail."
F0 = "{:.0f}"  # milliseconds and megabytes in the tables

# first-token variants of the int8 model beside the defaults (--variants): no integer activations
# (a bf16 vision tower, float products) and int8 x int8 products everywhere
VARIANTS = {"float": ["--int8-activations", "off", "--no-vision-int8"], "all": ["--int8-activations", "all"]}


def run_qvl(args, tier: str, weights: str, extra: tuple[str, ...] = ()) -> dict:
    env = common.tier_env(tier)
    cmd = [sys.executable, "-m", "qvl.cli", "bench", "--model", args.model, "--weights", weights, "--threads",
           str(args.threads), "--image", "1920x1080", "--new-tokens", "32", "--repeat", "2", "--json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"qvl bench ({tier}, {weights}) failed:\n{done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {"decode_ms": r["decode_ms_per_token"], "ttft_ms": r["ttft_ms"], "vision_ms": r["vision_ms"],
            "prefill_ms": r["prefill_ms"], "rss_mb": r["peak_rss_mb"], "image_tokens": r["image_tokens"],
            "dtype": r["dtype"], "vision": "int8" if "vision-int8" in r["model_id"] else "bf16",
            "int8_activations": r["int8_activations"]}


def run_llama_decode(args, bin_dir: str, weights: str) -> float:
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", os.path.join(args.gguf, GGUF[weights]), "-p", "0", "-n", "32",
           "-t", str(args.threads), "-r", "2", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed:\n{done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    return 1000.0 / rows[0]["avg_ts"]


def run_llama_ttft(args, bin_dir: str, weights: str) -> dict:
    """Time to first token of llama-mtmd-cli on the photo: image encode + image and text
    prefill + one token, read from its own timing lines (model loading excluded)."""
    cmd = [os.path.join(bin_dir, "llama-mtmd-cli"), "-m", os.path.join(args.gguf, GGUF[weights]), "--mmproj",
           os.path.join(args.gguf, args.mmproj), "-c", "4096", "-n", "1", "-t", str(args.threads), "--temp", "0",
           "--image", args.photo, "-p", PROMPT, "--image-max-tokens", "256", "--perf", "-lv", "4"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"llama-mtmd-cli failed:\n{done.stderr[-2000:]}")
    log = done.stdout + done.stderr
    encode = sum(float(x) for x in re.findall(r"mtmd batch encoding done in (\d+) ms", log))
    prompt = re.search(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens", log)  # image + text, encode included
    image = re.search(r"n_tokens_batch = (\d+)", log)
    return {"ttft_ms": float(prompt.group(1)), "vision_ms": encode, "wall_ms": wall * 1000,
            "image_tokens": int(image.group(1)) if image else None, "prompt_tokens": int(prompt.group(2))}


def vision_worker(args) -> None:
    """In a process held to one tier: transformers' vision tower (float32, as a CPU without
    bf16 products runs it) and qvl's as its defaults run it there (int8 model: int8 vision
    weights, int8 x int8 products where the tier's integer products are faster) on the photo
    at the default budget, alternating; prints JSON."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qvl.bench import synthetic_image
    from qvl.engine import Engine, EngineOptions
    from qvl.processing.image import max_pixels_for_tokens, preprocess

    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineOptions(model=args.model, threads=args.threads))
    dtype = engine.model.dtype
    reference = Qwen3VLForConditionalGeneration.from_pretrained(args.model, dtype=dtype).eval()
    config = json.load(open(os.path.join(args.model, "preprocessor_config.json")))
    max_pixels = max_pixels_for_tokens(256, engine.image_cfg)
    proc = Qwen2VLImageProcessorPil(**{**config, "size": {"shortest_edge": 65536, "longest_edge": max_pixels}})
    image = synthetic_image(1920, 1080)
    pixels = proc(images=[image], return_tensors="pt")
    processed = preprocess(image, engine.image_cfg, max_pixels=max_pixels)
    assert tuple(pixels["image_grid_thw"][0].tolist()) == processed.grid_thw, "both sides must see the same grid"
    runs = {"transformers": lambda: reference.model.get_image_features(pixels["pixel_values"].to(dtype),
                                                                       pixels["image_grid_thw"]),
            "qvl": lambda: engine.model.encode_images(processed.pixel_values, [processed.grid_thw])}
    times: dict[str, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for fn in runs.values():
            fn()  # warm-up
        for _ in range(args.rounds):
            for name, fn in runs.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    print(json.dumps({"dtype": str(dtype), "patches": int(pixels["image_grid_thw"].prod()), "times": times}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gguf", help="folder with qvl-2b-Q8_0.gguf, qvl-2b-Q4_0.gguf and the mmproj")
    p.add_argument("--mmproj", default="mmproj-qvl-2b-f16.gguf")
    p.add_argument("--photo", help="llama.cpp's 1920x1080 photo (default: qvl bench's synthetic one, written here)")
    p.add_argument("--llama", action="append", default=[], help="TIER=BIN_DIR of a llama.cpp build (repeatable)")
    p.add_argument("--tiers", default="avx512,avx512-nobf16,avx2")
    p.add_argument("--weights", default="int8,int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-vision", action="store_true")
    p.add_argument("--variants", action="store_true", help="also the int8 model's first token without integer "
                   "activations and with int8 activations everywhere, on the tiers without bf16 products")
    p.add_argument("--out", help="also write the raw results here (JSON)")
    p.add_argument("--vision-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vision_worker:
        return vision_worker(args)
    tiers, weights = args.tiers.split(","), args.weights.split(",")
    llama = dict(item.split("=", 1) for item in args.llama)
    with tempfile.TemporaryDirectory() as tmp:
        if args.photo is None:
            from qvl.bench import synthetic_image

            args.photo = os.path.join(tmp, "photo-1920x1080.png")
            synthetic_image(1920, 1080).save(args.photo)
        measure_all(args, tiers, weights, llama)


def measure_all(args, tiers: list[str], weights: list[str], llama: dict[str, str]) -> None:
    results: dict[str, list] = {}

    def record(key: str, value) -> None:
        results.setdefault(key, []).append(value)
        print(f"  {key}: {value}", flush=True)

    float32_tiers = [t for t in tiers if not t.startswith("avx512") or t == "avx512-nobf16"]  # no bf16 products
    variants = {t: VARIANTS if args.variants and "int8" in weights and t in float32_tiers else {} for t in tiers}
    for tier in tiers:  # the first start of a tier's dtype quantises and keeps the weights: not measured
        for w in weights:
            run_qvl(args, tier, w)
        for extra in variants[tier].values():
            run_qvl(args, tier, "int8", tuple(extra))
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}", flush=True)
        order = tiers if rnd % 2 == 0 else tiers[::-1]
        for tier in order:
            for w in weights:
                record(f"qvl|{tier}|{w}", run_qvl(args, tier, w))
                if tier in llama and args.gguf:
                    record(f"llama|{tier}|{w}|decode", run_llama_decode(args, llama[tier], w))
                    if w == "int8":
                        record(f"llama|{tier}|{w}|ttft", run_llama_ttft(args, llama[tier], w))
            for name, extra in variants[tier].items():
                record(f"qvl|{tier}|int8|{name}", run_qvl(args, tier, "int8", tuple(extra)))
    if not args.skip_vision:
        for tier in tiers:
            if tier == "avx512":
                continue
            cmd = [sys.executable, __file__, "--vision-worker", "--model", args.model, "--rounds", str(args.rounds),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=common.tier_env(tier), timeout=3600)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            record(f"vision|{tier}", json.loads(done.stdout.strip().splitlines()[-1]))
    report(results, tiers, weights, llama, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def report(results, tiers, weights, llama, args) -> None:
    print(f"\n{args.threads} threads, {args.rounds} alternating rounds; medians (min-max)\n")
    print("| tier | weights | compute | decode ms/token | first token ms (vision + prefill) | peak RSS MB |"
          " decode vs avx512 tier | llama.cpp decode ms/token | qvl vs llama.cpp decode |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {w: statistics.median(r["decode_ms"] for r in results.get(f"qvl|avx512|{w}", [{"decode_ms": 0}]))
            for w in weights}
    for tier in tiers:
        for w in weights:
            rows = results[f"qvl|{tier}|{w}"]
            dec = [r["decode_ms"] for r in rows]
            ttft = [r["ttft_ms"] for r in rows]
            vis, pre = statistics.median(r["vision_ms"] for r in rows), statistics.median(r["prefill_ms"] for r in rows)
            lla = results.get(f"llama|{tier}|{w}|decode")
            compute = rows[0]["dtype"] + f", vision {rows[0].get('vision', 'bf16')}" + (
                f" (int8 act.: {rows[0]['int8_activations']})" if rows[0].get("int8_activations", "off") != "off" else "")
            first = f"{common.spread(ttft, F0)} ({vis:.0f} + {pre:.0f})"
            cells = [tier, w, compute, common.spread(dec, "{:.1f}"), first,
                     common.spread([r["rss_mb"] for r in rows], F0),
                     f"{statistics.median(dec) / base[w]:.2f}×" if base[w] else "—",
                     common.spread(lla, "{:.1f}") if lla else "—",
                     f"{statistics.median(lla) / statistics.median(dec):.2f}× faster" if lla else "—"]
            print("| " + " | ".join(cells) + " |")
    print("\n| tier | qvl first token ms (int8) | llama.cpp first token ms (Q8_0; its encode) | qvl vs llama.cpp |")
    print("|---|---|---|---|")
    for tier in tiers:
        lla = results.get(f"llama|{tier}|int8|ttft")
        if not lla or f"qvl|{tier}|int8" not in results:
            continue
        ours = [r["ttft_ms"] for r in results[f"qvl|{tier}|int8"]]
        theirs = [r["ttft_ms"] for r in lla]
        encode = statistics.median(r["vision_ms"] for r in lla)
        print(f"| {tier} | {common.spread(ours, F0)} | {common.spread(theirs, F0)} ({encode:.0f}) | "
              f"{statistics.median(theirs) / statistics.median(ours):.2f}× faster |")
    rows = [t for t in tiers if f"qvl|{t}|int8|float" in results]
    if rows:
        print("\n| tier | int8 model's first token ms: no int8 activations (vision + prefill) | defaults | int8 "
              "activations everywhere | defaults vs none | everywhere vs none |\n|---|---|---|---|---|---|")
        for tier in rows:
            runs = {k: results[f"qvl|{tier}|int8{k}"] for k in ("|float", "", "|all")}
            med = {k: statistics.median(r["ttft_ms"] for r in v) for k, v in runs.items()}
            parts = {k: f"{common.spread([r['ttft_ms'] for r in v], F0)} "
                        f"({statistics.median(r['vision_ms'] for r in v):.0f} + "
                        f"{statistics.median(r['prefill_ms'] for r in v):.0f})" for k, v in runs.items()}
            print(f"| {tier} | {parts['|float']} | {parts['']} | {parts['|all']} | {med['|float'] / med['']:.2f}× | "
                  f"{med['|float'] / med['|all']:.2f}× |")
    vis = [(t, results[f"vision|{t}"][0]) for t in tiers if f"vision|{t}" in results]
    if vis:
        print("\n| tier | patches | transformers vision s | qvl vision s | speed-up |\n|---|---|---|---|---|")
        for tier, r in vis:
            tr, qv = r["times"]["transformers"], r["times"]["qvl"]
            print(f"| {tier} ({r['dtype']}) | {r['patches']} | {common.spread(tr)} | {common.spread(qv)} | "
                  f"{statistics.median(tr) / statistics.median(qv):.2f}× |")


if __name__ == "__main__":
    main()
