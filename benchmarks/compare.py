"""Side-by-side: transformers (bf16 `generate`, its own processor) against qvl in each
weight format, on the same checkpoint and workload, in one session; plus this machine's
read bandwidth and bf16 GEMM rate, measured in the same run.

    python benchmarks/compare.py --model /work/ckpt/qvl-2b --out docs/bench-results.json

qvl configurations (CONFIGS): bf16, int8 (the default), int8-fast (int8 with --vision-int8
--int8-activations), int4, int4-vision-int8.

Each configuration runs in its own process (peak RSS is per process). Prints markdown
tables; writes the raw results as JSON (for benchmarks/plots.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "Describe this image in detail."
# qvl configurations: name -> (`qvl bench` flags, the weight format whose bytes set the decode floor)
CONFIGS = {
    "bf16": (["--weights", "bf16"], "bf16"),
    "int8": (["--weights", "int8"], "int8"),
    "int8-fast": (["--weights", "int8", "--vision-int8", "--int8-activations"], "int8"),
    "int4": (["--weights", "int4"], "int4"),
    "int4-vision-int8": (["--weights", "int4", "--vision-int8"], "int4"),
}


def median_time(fn, repeat: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def machine_rates(threads: int) -> dict:
    """Read bandwidth and bf16 GEMM rate (2048^3), in-process. Bandwidth is a streaming sum
    over 1 GiB held as 64 tensors of 16 MiB, the size of the model's matrices: on this VM one
    big allocation reads anywhere from 34 to 43 GB/s depending on where it lands, and the
    median over many weight-sized tensors is what a decode step can expect. The single-tensor
    figure is reported too."""
    import torch

    torch.set_num_threads(threads)
    pieces = [torch.ones(2**23, dtype=torch.bfloat16) for _ in range(64)]
    read_s = median_time(lambda: [t.sum() for t in pieces], 5)
    del pieces
    big = torch.ones(2**29, dtype=torch.bfloat16)
    big_s = median_time(lambda: big.sum(), 5)
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    gemm_s = median_time(lambda: a @ a, 5)
    return {"read_gb_s": 2**30 / read_s / 1e9, "read_one_tensor_gb_s": big.nbytes / big_s / 1e9,
            "bf16_gemm_tflops": 2 * 2048**3 / gemm_s / 1e12}


def text_weight_bytes(model_dir: str) -> dict:
    """Bytes a decode step must read per format: every text-decoder matrix and the lm_head."""
    import torch

    from qvl.config import ModelConfig
    from qvl.model.qwen3_vl import Qwen3VL

    with torch.device("meta"):
        model = Qwen3VL(ModelConfig.from_file(os.path.join(model_dir, "config.json")))
    params = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and (n.startswith("language_model.") or n == "lm_head"))
    # int4: half a byte per weight plus a bf16 scale and zero per group of 128
    return {"params": params, "bf16": 2 * params, "fp32": 4 * params, "int8": params,
            "int4": params // 2 + params // 128 * 4}


# -- transformers baseline (runs in a worker process) ---------------------------------------

def transformers_worker(args) -> dict:
    import resource

    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qvl.bench import synthetic_image

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = Qwen3VLForConditionalGeneration.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_s = time.perf_counter() - started
    config = json.load(open(os.path.join(args.model, "preprocessor_config.json")))
    template = open(os.path.join(args.model, "chat_template.jinja")).read()
    results = {"load_s": load_s}
    for label, (w, h), max_pixels in workloads(args):
        proc = Qwen2VLImageProcessorPil(**{**config, "size": {"shortest_edge": 65536, "longest_edge": max_pixels}})
        image = synthetic_image(w, h)
        pixels = proc(images=[image], return_tensors="pt")
        n_tokens = int(pixels["image_grid_thw"].prod()) // 4
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        text = text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == 151655).int(),
                  **pixels}
        heavy = label == "full_budget"  # minutes per run on a CPU: measured once, no warm-up
        repeat = 1 if heavy else args.repeat
        with torch.inference_mode():
            vision_s = median_time(lambda: model.model.get_image_features(pixels["pixel_values"],
                                                                          pixels["image_grid_thw"]), repeat, not heavy)
            gen = lambda n: model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # noqa: E731
            ttft_s = median_time(lambda: gen(1), repeat, not heavy)
            row = {"image_tokens": n_tokens, "prompt_tokens": ids.shape[1], "vision_ms": vision_s * 1000,
                   "ttft_ms": ttft_s * 1000, "prefill_ms": (ttft_s - vision_s) * 1000}
            if label == "decode":
                total = median_time(lambda: gen(args.new_tokens + 1), max(1, args.repeat - 1))
                row["decode_ms_per_token"] = (total - ttft_s) / args.new_tokens * 1000
        results[label] = row
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def workloads(args):
    """(label, image size, max_pixels): the full-budget photo, the qvl default budget,
    the seed's 384x384 budget, and the decode workload."""
    full = 16384 * 32 * 32
    decode = ("decode", (1920, 1080), args.default_tokens * 32 * 32)
    if args.decode_only:
        return [decode]
    return [("full_budget", (1920, 1080), full), ("seed_384", (1920, 1080), 384 * 384), decode]


# -- qvl (each format in its own process, through `qvl bench --json`) -----------------------

def qvl_bench(args, config: str, image_tokens: int, new_tokens: int, repeat: int) -> dict:
    cmd = [sys.executable, "-m", "qvl.cli", "bench", "--model", args.model, *CONFIGS[config][0],
           "--threads", str(args.threads), "--image", "1920x1080", "--max-image-tokens", str(image_tokens),
           "--new-tokens", str(new_tokens), "--repeat", str(repeat), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_all(args) -> dict:
    results = {"machine": machine_rates(args.threads), "weight_bytes": text_weight_bytes(args.model),
               "threads": args.threads, "cpu": cpu_name()}
    worker = subprocess.run([sys.executable, __file__, "--worker", "transformers", *sys.argv[1:]],
                            capture_output=True, text=True, check=True)
    results["transformers"] = json.loads(worker.stdout.strip().splitlines()[-1])
    results["qvl"] = {}
    results["floor_format"] = {config: CONFIGS[config][1] for config in args.configs}
    for config in args.configs:
        results["qvl"][config] = {"default": qvl_bench(args, config, args.default_tokens, args.new_tokens, args.repeat)}
        if not args.decode_only:
            results["qvl"][config]["full_budget"] = qvl_bench(args, config, 16384, 2, 1)
    if args.decode_only:
        return results
    sweep = {t: qvl_bench(args, "int8", t, 2, args.repeat) for t in args.budgets}
    results["vision_vs_budget"] = {str(t): r["vision_ms"] for t, r in sweep.items()}
    results["ttft_vs_budget"] = {str(t): r["ttft_ms"] for t, r in sweep.items()}
    return results


def cpu_name() -> str:
    from qvl.runtime import cpu_model

    return cpu_model()


def report(r: dict) -> str:
    m, wb, tf = r["machine"], r["weight_bytes"], r["transformers"]
    lines = [f"Machine: {r['cpu']}, {r['threads']} threads; read bandwidth {m['read_gb_s']:.1f} GB/s over "
             f"weight-sized tensors ({m['read_one_tensor_gb_s']:.1f} GB/s over one 1 GiB tensor), "
             f"bf16 GEMM {m['bf16_gemm_tflops']:.2f} TFLOP/s (measured in this run).", ""]
    lines += ["| decode (1920x1080 prompt) | ms/token | floor ms | × floor | speed-up vs transformers bf16 |",
              "|---|---|---|---|---|"]
    tf_decode = tf["decode"]["decode_ms_per_token"]
    lines.append(f"| transformers bf16 | {tf_decode:.1f} | {wb['bf16'] / m['read_gb_s'] / 1e6:.1f} | "
                 f"{tf_decode / (wb['bf16'] / m['read_gb_s'] / 1e6):.2f} | 1.00 |")
    for fmt, q in r["qvl"].items():
        floor = wb[r["floor_format"][fmt]] / m["read_gb_s"] / 1e6
        ms = q["default"]["decode_ms_per_token"]
        lines.append(f"| qvl {fmt} | {ms:.1f} | {floor:.1f} | {ms / floor:.2f} | {tf_decode / ms:.2f} |")
    if "full_budget" not in tf:  # --decode-only
        return "\n".join(lines)
    lines += ["", "| 1920x1080 at the full budget | image tokens | vision ms | prefill ms | vision speed-up | "
              "prefill speed-up |", "|---|---|---|---|---|---|"]
    tfull = tf["full_budget"]
    lines.append(f"| transformers bf16 | {tfull['image_tokens']} | {tfull['vision_ms']:.0f} | "
                 f"{tfull['prefill_ms']:.0f} | 1.00 | 1.00 |")
    for fmt, q in r["qvl"].items():
        f = q["full_budget"]
        lines.append(f"| qvl {fmt} | {f['image_tokens']} | {f['vision_ms']:.0f} | {f['prefill_ms']:.0f} | "
                     f"{tfull['vision_ms'] / f['vision_ms']:.2f} | {tfull['prefill_ms'] / f['prefill_ms']:.2f} |")
    lines += ["", "| time to first token, 1920x1080 + question | image tokens | TTFT ms | peak RSS MB | load s |",
              "|---|---|---|---|---|"]
    seed = tf["seed_384"]
    lines.append(f"| transformers bf16, seed's 384x384 budget | {seed['image_tokens']} | {seed['ttft_ms']:.0f} | "
                 f"{tf['peak_rss_mb']:.0f} | {tf['load_s']:.1f} |")
    for fmt, q in r["qvl"].items():
        d = q["default"]
        lines.append(f"| qvl {fmt}, default budget | {d['image_tokens']} | {d['ttft_ms']:.0f} | "
                     f"{d['peak_rss_mb']:.0f} | {d['load_s']:.1f} |")
    lines += ["", "| image budget (tokens) | " + " | ".join(r["vision_vs_budget"]) + " |",
              "|---|" + "---|" * len(r["vision_vs_budget"]),
              "| qvl int8 vision ms | " + " | ".join(f"{v:.0f}" for v in r["vision_vs_budget"].values()) + " |",
              "| qvl int8 TTFT ms | " + " | ".join(f"{v:.0f}" for v in r["ttft_vs_budget"].values()) + " |"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--default-tokens", type=int, default=1024, help="qvl's default image budget")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--budgets", nargs="+", type=int, default=[64, 144, 256, 576, 1024, 2040])
    p.add_argument("--decode-only", action="store_true", help="only the decode table (minutes instead of ~20)")
    p.add_argument("--out", help="write the raw results here (JSON)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.worker == "transformers":
        print(json.dumps(transformers_worker(args)))
        return
    results = run_all(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(report(results))


if __name__ == "__main__":
    main()
