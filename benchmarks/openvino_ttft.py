"""OpenVINO GenAI's time to first token on a photo, to set beside qvl's: the checkpoint exported to
OpenVINO IR by optimum-intel (int8 weights), run by openvino_genai.VLMPipeline on the CPU.

Runs in its own virtualenv, not the project's: optimum-intel 2.2 wants transformers < 5.6 and
refuses the Qwen3-VL export above 5.0; the torchvision it pulls (PyPI's, built against CUDA torch)
fails to import beside the CPU torch and the export runs without it, so it is removed:

    python -m venv /work/ov-venv
    /work/ov-venv/bin/pip install --no-cache-dir torch==2.13.0+cpu openvino==2026.4.1 \
        openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 "optimum-intel[openvino]==2.2.0" \
        transformers==4.57.6 pillow
    /work/ov-venv/bin/pip uninstall -y torchvision
    /work/ov-venv/bin/optimum-cli export openvino --model /work/ckpt/qvl-2b \
        --task image-text-to-text --weight-format int8 /work/ov-2b-int8
    /work/ov-venv/bin/python benchmarks/openvino_ttft.py --model /work/ov-2b-int8 \
        --image-tokens 256,1024 --rounds 3 --threads 2 --out docs/openvino-ttft.json

Image budget: VLMPipeline reads the resize limit from the folder's preprocessor_config.json
(max_pixels, else size.longest_edge) when it is built, so each budget gets a folder of symlinks to
the export with that file rewritten: max_pixels = tokens * (patch_size * merge_size)^2, as the
Qwen3-VL processor, qvl and llama.cpp do (256 tokens: the 1920x1080 photo becomes 672x384
pixels, 42x24 patches, 252 merged tokens). The tokens it really used are counted: input tokens of
the photo prompt less those of the chat-templated prompt alone and <|vision_start|><|vision_end|>.

Per budget: the pipeline is built on "CPU" (INFERENCE_NUM_THREADS=--threads), one warm-up, then
--rounds greedy generates of one new token. TTFT is PerfMetrics.get_ttft() (from the call's start,
so image resize, vision encoder and prefill), wall is the whole generate() call. The default
backend is GenAI's CPU default, paged attention, but with prefix caching off (its default config
turns it on, which may let a repeat of the same prompt reuse cached KV blocks); --backend sdpa
takes the stateful pipeline instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from PIL import Image

PROMPT = "Describe this image in detail."


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL/Qwen3-VL processor's resize: sides multiples of factor, area within the limits."""
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def budget_folder(model: str, tokens: int, root: str) -> tuple[str, dict]:
    """A folder of symlinks to the export whose preprocessor_config.json caps the image at `tokens`."""
    with open(os.path.join(model, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    factor = cfg["patch_size"] * cfg["merge_size"]
    max_pixels = tokens * factor * factor
    min_pixels = cfg.get("min_pixels") or cfg.get("size", {}).get("shortest_edge", 0)
    cfg["max_pixels"] = max_pixels
    cfg["min_pixels"] = min_pixels
    cfg.setdefault("size", {})["longest_edge"] = max_pixels
    cfg["size"]["shortest_edge"] = min_pixels
    folder = os.path.join(root, f"budget-{tokens}")
    os.makedirs(folder)
    for name in os.listdir(model):
        if name != "preprocessor_config.json":
            os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(folder, name))
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return folder, {"factor": factor, "min_pixels": min_pixels, "max_pixels": max_pixels}


def build(folder: str, args) -> ov_genai.VLMPipeline:
    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.backend == "pa":
        sched = ov_genai.SchedulerConfig()  # GenAI's latency-oriented default, less the prefix cache
        sched.max_num_batched_tokens = sys.maxsize
        sched.enable_prefix_caching = False
        props["scheduler_config"] = sched
    else:
        props["ATTENTION_BACKEND"] = "SDPA"
    return ov_genai.VLMPipeline(folder, "CPU", **props)


def run_budget(args, tokens: int, image: np.ndarray, root: str) -> dict:
    folder, limits = budget_folder(args.model, tokens, root)
    h, w = image.shape[:2]
    gh, gw = smart_resize(h, w, limits["factor"], limits["min_pixels"], limits["max_pixels"])
    expected = (gh // limits["factor"]) * (gw // limits["factor"])
    t0 = time.perf_counter()
    pipe = build(folder, args)
    load_s = time.perf_counter() - t0
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = 1
    cfg.do_sample = False
    photo = ov.Tensor(image[None])

    def once() -> dict:
        t = time.perf_counter()
        res = pipe.generate(args.prompt, images=[photo], generation_config=cfg)
        wall = (time.perf_counter() - t) * 1000
        m = res.perf_metrics
        return {"ttft_ms": m.get_ttft().mean, "wall_ms": wall, "vision_ms": m.get_vision_encoding_duration().mean,
                "embeddings_ms": m.get_prepare_embeddings_duration().mean, "input_tokens": m.get_num_input_tokens(),
                "text": res.texts[0]}

    warm = once()
    tok = pipe.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    text_only = int(tok.encode(chat, add_special_tokens=False).input_ids.shape[1])
    used = warm["input_tokens"] - text_only - 2  # less <|vision_start|> and <|vision_end|>
    runs = []
    for rnd in range(args.rounds):
        r = once()
        runs.append(r)
        print(f"  {tokens} tokens, round {rnd + 1}: ttft {r['ttft_ms']:.1f} ms, wall {r['wall_ms']:.1f} ms, "
              f"vision {r['vision_ms']:.1f} ms", flush=True)
        if r["input_tokens"] != warm["input_tokens"]:
            raise RuntimeError(f"input tokens changed between calls: {r['input_tokens']} vs {warm['input_tokens']}")
    del pipe
    return {"image_tokens_budget": tokens, **limits, "resized_hw": [gh, gw], "expected_image_tokens": expected,
            "measured_image_tokens": used, "input_tokens": warm["input_tokens"], "text_only_input_tokens": text_only,
            "load_s": load_s, "warmup_ttft_ms": warm["ttft_ms"], "first_token": warm["text"],
            "ttft_ms": [r["ttft_ms"] for r in runs], "wall_ms": [r["wall_ms"] for r in runs],
            "vision_ms": [r["vision_ms"] for r in runs], "embeddings_ms": [r["embeddings_ms"] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a folder exported by optimum-cli export openvino")
    p.add_argument("--photo", default="/work/ckpt/photo-1920x1080.jpg")
    p.add_argument("--image-tokens", default="256,1024", help="comma-separated image budgets (merged tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--backend", choices=["pa", "sdpa"], default="pa",
                   help="pa: paged attention without prefix caching (GenAI's CPU default otherwise); sdpa: stateful")
    p.add_argument("--out")
    args = p.parse_args()
    image = np.asarray(Image.open(args.photo).convert("RGB"))
    budgets = [int(t) for t in args.image_tokens.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="ov-ttft-") as root:
        for tokens in budgets:
            results.append(run_budget(args, tokens, image, root))
    print(f"\nOpenVINO GenAI {ov_genai.__version__}, {args.backend}, {args.threads} threads, "
          f"{os.path.basename(os.path.normpath(args.model))}, photo {image.shape[1]}x{image.shape[0]}, "
          f"{args.rounds} rounds\n")
    print("| budget | image tokens (expected) | TTFT ms median (min-max) | wall ms | vision ms |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['image_tokens_budget']} | {r['measured_image_tokens']} ({r['expected_image_tokens']}) | "
              f"{spread(r['ttft_ms'])} | {spread(r['wall_ms'])} | {spread(r['vision_ms'])} |")
    for r in results:
        if r["measured_image_tokens"] != r["expected_image_tokens"]:
            print(f"warning: budget {r['image_tokens_budget']} used {r['measured_image_tokens']} image tokens, "
                  f"the Qwen3-VL processor would use {r['expected_image_tokens']}", file=sys.stderr)
    if args.out:
        meta = {"openvino": ov.__version__, "openvino_genai": ov_genai.__version__, "model": args.model,
                "photo": args.photo, "threads": args.threads, "rounds": args.rounds, "backend": args.backend,
                "prompt": args.prompt, "max_new_tokens": 1}
        with open(args.out, "w") as f:
            json.dump({**meta, "budgets": results}, f, indent=1)


if __name__ == "__main__":
    main()
