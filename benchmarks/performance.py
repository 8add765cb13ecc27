"""qvl beside transformers, llama.cpp and OpenVINO GenAI on one checkpoint, on the CPU it runs on:
rewrites that CPU class's section of docs/performance.md.

    .venv/bin/python benchmarks/performance.py [--model /work/ckpt/qvl-2b] [--rounds 5] [--threads 2]
        [--peers all] [--out docs/performance.md] [--plot docs/performance.png] [--json results.json]

The workload: a 512x512 photo-like image (256 image tokens, within every engine's image budget of
--image-tokens) and "Describe this image in detail.", greedy, then --new-tokens tokens with EOS
ignored. Per engine: the time to the first token (image preprocessing, vision encoder, prefill,
first sample; from the call, not from loading), decode ms per token after the first, and the peak
resident memory of its process (ru_maxrss from wait4, loading included).

Every engine configuration runs in a fresh process of its own each round, in an order rotated by
one each round, so no engine always follows the same one; each round loads the model, answers a
warm-up request on another image (qvl: see below), then the measured one. The table gives the
median over rounds and the min-max spread, and the largest peak RSS.

- qvl int8 (the default) and int4: `qvl bench -i IMAGE --max-image-tokens B --repeat 3 --json`
  (caches off); it has no separate warm-up, so the first of its three requests is the cold one
  and the median is the slower of the two warm ones. Decode: the median of the per-token times.
- transformers bf16 (the reference; the project venv's, the bench extra): the checkpoint's chat
  template and its image processor (PIL backend: the Qwen3-VL AutoProcessor wants torchvision for
  its video half; longest_edge = the budget in pixels), `generate` with
  min_new_tokens=max_new_tokens and a streamer that stamps each token. Decode: (last stamp -
  first) / (tokens - 1).
- llama.cpp Q8_0 and Q4_0: llama-server with the f16 mmproj, `-c 4096 -t/-tb THREADS
  --image-max-tokens B`, prompt cache off; one non-streamed chat completion. First token: the
  request's wall time less the server's generation time after the first token (timings); decode:
  the server's predicted_per_token_ms.
- OpenVINO GenAI int8 and int4: VLMPipeline on "CPU" (INFERENCE_NUM_THREADS, paged attention with
  prefix caching off), over a folder of symlinks to the export whose preprocessor_config.json
  caps the image at the budget (as the Qwen3-VL processor computes it). First token: PerfMetrics
  get_ttft (from the call); decode: get_tpot.

Peers it does not find are skipped with a line saying so (and listed under the table). Where
they are looked for (options, or the environment):
- llama.cpp binaries: --llama-bin, $QVL_LLAMA_BIN, default /work/peers/llama/build/bin
- GGUF files: --gguf-dir, $QVL_GGUF_DIR, default <model's folder>/gguf, named <model>-Q8_0.gguf,
  <model>-Q4_0.gguf and mmproj-<model>-f16.gguf (<model>: the checkpoint folder's name)
- OpenVINO: --ov-python, $QVL_OV_PYTHON, default /work/peers/ov-venv/bin/python; exports under
  --ov-dir, $QVL_OV_DIR, default <model's folder>/ov, named <model>-int8 and <model>-int4
- transformers: --hf-python, $QVL_HF_PYTHON, default this interpreter
benchmarks/README.md says how to build them from the checkpoint.

Timings on a busy machine mean nothing: run it alone on a quiet one.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

PROMPT = "Describe this image in detail."
REPO = os.path.dirname(HERE)
HEADER = """# Performance

qvl beside transformers, llama.cpp and OpenVINO GenAI on the same checkpoint: time to the first
token for a photo, decode speed and peak memory, one section per CPU class.
`.venv/bin/python benchmarks/performance.py` regenerates the section of the CPU it runs on (its
docstring says how each engine is measured; benchmarks/README.md how to build the peers).
"""


# -- the engines --------------------------------------------------------------------------------

@dataclass
class Engine:
    key: str
    label: str
    missing: Callable[[argparse.Namespace], str | None]  # why it cannot run here, or None
    measure: Callable[[argparse.Namespace, dict], dict]  # one round in a fresh process


def qvl_engine(weights: str) -> Engine:
    def measure(args, images) -> dict:
        cmd = [sys.executable, "-m", "qvl.cli", "bench", "--model", args.model, "--weights", weights,
               "--threads", str(args.threads), "-i", images["measured"], "--max-image-tokens",
               str(args.image_tokens), "--new-tokens", str(args.new_tokens), "--repeat", "3", "--json"]
        done = checked(common.run(cmd, args.timeout, cwd=REPO), cmd)
        r = last_json(done)
        return {"ttft_s": r["ttft_ms"] / 1000, "decode_ms": r["decode_ms_per_token"], "rss": done.peak_rss_bytes,
                "image_tokens": r["image_tokens"], "prompt_tokens": r["prompt_tokens"],
                "generated": r["new_tokens"]}

    return Engine(f"qvl-{weights}", f"qvl {weights}" + (" (default)" if weights == "int8" else ""),
                  lambda args: None, measure)


def worker_engine(key: str, label: str, python: Callable, missing: Callable, model: Callable) -> Engine:
    """An engine run by this script's --worker KEY under another interpreter."""
    def measure(args, images) -> dict:
        cmd = [python(args), os.path.abspath(__file__), "--worker", key, "--model", model(args),
               "--image", images["measured"], "--warm-image", images["warm"], "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens), "--image-tokens", str(args.image_tokens)]
        done = checked(common.run(cmd, args.timeout), cmd)
        return {**last_json(done), "rss": done.peak_rss_bytes}

    return Engine(key, label, missing, measure)


def llama_engine(quant: str) -> Engine:
    def missing(args) -> str | None:
        return first_missing([llama_server(args), gguf(args, quant), mmproj(args)])

    return Engine(f"llama-{quant.lower()}", f"llama.cpp {quant}", missing,
                  lambda args, images: llama_measure(args, gguf(args, quant), images))


def openvino_engine(weights: str) -> Engine:
    def missing(args) -> str | None:
        return first_missing([args.ov_python, os.path.join(ov_export(args, weights), "openvino_language_model.xml")])

    return worker_engine(f"openvino-{weights}", f"OpenVINO GenAI {weights}", lambda args: args.ov_python, missing,
                         lambda args: ov_export(args, weights))


def transformers_missing(args) -> str | None:
    done = common.run([args.hf_python, "-c", "import transformers; print(transformers.__version__)"], 120)
    return None if done.returncode == 0 else f"{args.hf_python} cannot import transformers"


ENGINES = [qvl_engine("int8"), qvl_engine("int4"),
           worker_engine("transformers", "transformers bf16", lambda args: args.hf_python, transformers_missing,
                         lambda args: args.model),
           llama_engine("Q8_0"), llama_engine("Q4_0"), openvino_engine("int8"), openvino_engine("int4")]
PEERS = [e.key for e in ENGINES if not e.key.startswith("qvl-")]


def model_name(args) -> str:
    return os.path.basename(os.path.normpath(args.model))


def gguf(args, quant: str) -> str:
    return os.path.join(args.gguf_dir, f"{model_name(args)}-{quant}.gguf")


def mmproj(args) -> str:
    return os.path.join(args.gguf_dir, f"mmproj-{model_name(args)}-f16.gguf")


def llama_server(args) -> str:
    return os.path.join(args.llama_bin, "llama-server")


def ov_export(args, weights: str) -> str:
    return os.path.join(args.ov_dir, f"{model_name(args)}-{weights}")


def first_missing(paths: list[str]) -> str | None:
    return next((f"no {p}" for p in paths if not os.path.exists(p)), None)


def checked(done: common.Finished, cmd: list[str]) -> common.Finished:
    if done.timed_out or done.returncode != 0:
        why = "timed out" if done.timed_out else f"exit {done.returncode}"
        raise RuntimeError(f"{' '.join(cmd[:4])} ... {why}:\n{done.tail()}")
    return done


def last_json(done: common.Finished) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- llama.cpp: llama-server, one process per round ---------------------------------------------

def llama_measure(args, model: str, images: dict) -> dict:
    port = common.free_port()
    cmd = [llama_server(args), "-m", model, "--mmproj", mmproj(args), "-c", "4096", "-t", str(args.threads),
           "-tb", str(args.threads), "--image-max-tokens", str(args.image_tokens), "-np", "1", "--cache-ram", "0",
           "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    server = common.Child(cmd)
    try:
        common.wait_healthy(server, port, args.timeout)
        chat(port, images["warm"], 4, args.timeout)
        started = time.perf_counter()
        reply = chat(port, images["measured"], args.new_tokens, args.timeout)
        wall = time.perf_counter() - started
    except Exception as e:
        done = server.finish(30, stop=True)
        raise RuntimeError(f"llama-server: {e}\n{done.tail()}") from None
    done = server.finish(30, stop=True)
    t = reply["timings"]
    return {"ttft_s": wall - t["predicted_ms"] / 1000, "decode_ms": t["predicted_per_token_ms"],
            "rss": done.peak_rss_bytes, "prompt_tokens": t["prompt_n"], "generated": t["predicted_n"],
            "version": llama_version(args)}


def chat(port: int, image: str, tokens: int, timeout: float) -> dict:
    with open(image, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": PROMPT}]}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def llama_version(args) -> str:
    done = common.run([llama_server(args), "--version"], 60)
    line = next((l for l in (done.stdout + done.stderr).splitlines() if l.startswith("version:")), "")
    return "llama.cpp " + line.removeprefix("version:").strip()


# -- workers: run under the peer's own interpreter, print one JSON line ----------------------------

def transformers_worker(args) -> dict:
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    model = Qwen3VLForConditionalGeneration.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    images = AutoImageProcessor.from_pretrained(args.model, backend="pil")
    token_pixels = (images.patch_size * images.merge_size) ** 2
    limits = {"shortest_edge": images.size["shortest_edge"], "longest_edge": args.image_tokens * token_pixels}
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def once(path: str, tokens: int) -> dict:
        stamps = common.TokenStamps()
        started = time.perf_counter()
        pixels = images(images=[Image.open(path).convert("RGB")], size=limits, return_tensors="pt")
        n_image = int(pixels["image_grid_thw"].prod()) // images.merge_size**2
        ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * n_image), return_tensors="pt")["input_ids"]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).int(),
                  **pixels}
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 streamer=stamps)
        return {"ttft_s": stamps.times[0] - started,
                "decode_ms": (stamps.times[-1] - stamps.times[0]) / max(1, len(stamps.times) - 1) * 1000,
                "image_tokens": n_image, "prompt_tokens": ids.shape[1], "generated": out.shape[1] - ids.shape[1]}

    once(args.warm_image, 4)
    return {**once(args.image, args.new_tokens), "version": f"transformers {transformers.__version__}"}


def openvino_worker(args) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="ov-budget-") as folder:
        budget_folder(args.model, args.image_tokens, folder)
        sched = ov_genai.SchedulerConfig()  # GenAI's CPU default (paged attention) less the prefix cache
        sched.max_num_batched_tokens = sys.maxsize
        sched.enable_prefix_caching = False
        pipe = ov_genai.VLMPipeline(folder, "CPU", INFERENCE_NUM_THREADS=args.threads, scheduler_config=sched)

        def once(path: str, tokens: int) -> dict:
            cfg = ov_genai.GenerationConfig()
            cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos, cfg.do_sample = tokens, tokens, True, False
            image = ov.Tensor(np.asarray(Image.open(path).convert("RGB"))[None])
            m = pipe.generate(PROMPT, images=[image], generation_config=cfg).perf_metrics
            return {"ttft_s": m.get_ttft().mean / 1000, "decode_ms": m.get_tpot().mean,
                    "prompt_tokens": m.get_num_input_tokens(), "generated": m.get_num_generated_tokens()}

        once(args.warm_image, 4)
        result = once(args.image, args.new_tokens)
    return {**result, "version": f"OpenVINO GenAI {ov_genai.__version__}"}


def budget_folder(model: str, tokens: int, folder: str) -> None:
    """Fill folder with symlinks to the export, its preprocessor_config.json rewritten so that
    VLMPipeline (which reads max_pixels, else size.longest_edge) caps an image at `tokens`."""
    with open(os.path.join(model, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    factor = cfg["patch_size"] * cfg["merge_size"]
    min_pixels = cfg.get("min_pixels") or cfg.get("size", {}).get("shortest_edge", 0)
    cfg["max_pixels"], cfg["min_pixels"] = tokens * factor * factor, min_pixels
    cfg["size"] = {"longest_edge": cfg["max_pixels"], "shortest_edge": min_pixels}
    for name in os.listdir(model):
        if name != "preprocessor_config.json":
            os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(folder, name))
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


WORKERS = {"transformers": transformers_worker, "openvino-int8": openvino_worker, "openvino-int4": openvino_worker}


# -- the run and the section ---------------------------------------------------------------------

def write_images(args, folder: str) -> dict:
    """The measured image and the warm-up's (another seed, so no engine reuses the first)."""
    from qvl.bench import parse_size, synthetic_image

    w, h = parse_size(args.image)
    paths = {}
    for name, seed in (("measured", 0), ("warm", 1)):
        paths[name] = os.path.join(folder, f"{name}.png")
        synthetic_image(w, h, seed).save(paths[name])
    return paths


def select(args) -> list[Engine]:
    wanted = PEERS if args.peers == "all" else [] if args.peers == "none" else args.peers.split(",")
    unknown = set(wanted) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PEERS)}, all, none)")
    return [e for e in ENGINES if e.key.startswith("qvl-") or e.key in wanted]


def run_rounds(args, engines: list[Engine], images: dict) -> dict:
    """{key: {"rounds": [result...], "errors": [str...]}}, engines alternating round by round."""
    results = {e.key: {"rounds": [], "errors": []} for e in engines}
    by_key = {e.key: e for e in engines}
    for r, order in common.rotations([e.key for e in engines], args.rounds):
        for key in order:
            try:
                res = by_key[key].measure(args, images)
            except Exception as e:  # noqa: BLE001 - a failed round is reported, the others go on
                results[key]["errors"].append(str(e))
                print(f"round {r + 1}, {by_key[key].label}: FAILED {e}", file=sys.stderr, flush=True)
                continue
            results[key]["rounds"].append(res)
            print(f"round {r + 1}, {by_key[key].label}: first token {res['ttft_s']:.2f} s, decode "
                  f"{res['decode_ms']:.1f} ms/token, peak RSS {res['rss'] / 1e9:.2f} GB, "
                  f"prompt {res['prompt_tokens']} tokens, {res['generated']} generated", flush=True)
    return results


def table(engines: list[Engine], results: dict) -> str:
    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in results[key]["rounds"])

    base = results.get("qvl-int8", {}).get("rounds")
    rows = []
    for e in engines:
        rounds = results[e.key]["rounds"]
        if not rounds:
            continue
        ttft, decode = [r["ttft_s"] for r in rounds], [r["decode_ms"] for r in rounds]
        rows.append([e.label, common.spread(ttft), common.ratio(med(e.key, "ttft_s"), med("qvl-int8", "ttft_s"))
                     if base else "-", common.spread(decode, "{:.1f}"),
                     common.ratio(med(e.key, "decode_ms"), med("qvl-int8", "decode_ms")) if base else "-",
                     f"{max(r['rss'] for r in rounds) / 1e9:.2f}"])
    return common.markdown_table(["engine / config", "first token (s) median (min-max)", "vs qvl int8",
                                  "decode ms/token median (min-max)", "vs qvl int8", "peak RSS (GB)"], rows)


def section(args, engines: list[Engine], results: dict, skipped: dict) -> str:
    info = common.cpuinfo()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    versions = sorted({r["version"] for v in results.values() for r in v["rounds"] if "version" in r})
    tokens = sorted({r["image_tokens"] for v in results.values() for r in v["rounds"] if "image_tokens" in r})
    lines = [f"{info.get('model name', 'unknown model')}; qvl {commit}, {datetime.date.today().isoformat()}; "
             f"{args.threads} threads, {args.rounds} rounds; checkpoint {model_name(args)}.", "",
             f"A {args.image} image ({', '.join(map(str, tokens)) or '?'} image tokens; budget {args.image_tokens}) "
             f"and \"{PROMPT}\", then {args.new_tokens} tokens greedy. vs qvl int8: the median over qvl int8's "
             f"(above 1: slower than qvl). Peak RSS: the largest over the rounds.", "", table(engines, results)]
    notes = [f"- {label}: not measured ({why})." for label, why in skipped.items()]
    for e in engines:
        errors = results[e.key]["errors"]
        if errors:
            notes.append(f"- {e.label}: {len(errors)} of {args.rounds} rounds failed: "
                         f"{errors[0].splitlines()[0]}")
    prompts = {e.label: results[e.key]["rounds"][0]["prompt_tokens"] for e in engines if results[e.key]["rounds"]}
    if len(set(prompts.values())) > 1:
        notes.append("- Prompt tokens (image and text) differ: "
                     + ", ".join(f"{label} {n}" for label, n in prompts.items()) + ".")
    if versions:
        notes.append(f"- Peers: {', '.join(versions)}.")
    return "\n".join(lines + ([""] + notes if notes else []))


def plot(path: str, engines: list[Engine], results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [e for e in engines if results[e.key]["rounds"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(shown) + 1.5))
    for ax, field, title in ((axes[0], "ttft_s", "first token (s)"), (axes[1], "decode_ms", "decode (ms/token)")):
        values = [[r[field] for r in results[e.key]["rounds"]] for e in shown]
        meds = [statistics.median(v) for v in values]
        err = [[m - min(v) for m, v in zip(meds, values)], [max(v) - m for m, v in zip(meds, values)]]
        ax.barh([e.label for e in shown], meds, xerr=err, color=["C0" if e.key.startswith("qvl") else "C7"
                                                                for e in shown])
        ax.invert_yaxis()
        ax.set_title(title + ", lower is better")
    fig.suptitle(common.cpu_class())
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--model", default=env("QVL_BENCH_MODEL", "/work/ckpt/qvl-2b"), help="a Qwen3-VL checkpoint")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers", default="all", help=f"comma-separated, of {', '.join(PEERS)}; or all, or none")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--plot", help="also draw the medians and spreads to this PNG (matplotlib)")
    p.add_argument("--json", help="also write every round's raw results here")
    p.add_argument("--image", default="512x512", help="the synthetic image, WIDTHxHEIGHT")
    p.add_argument("--image-tokens", type=int, default=256, help="every engine's image budget, in LLM tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one engine's round may take")
    p.add_argument("--llama-bin", default=env("QVL_LLAMA_BIN", "/work/peers/llama/build/bin"))
    p.add_argument("--gguf-dir", default=env("QVL_GGUF_DIR"))
    p.add_argument("--ov-python", default=env("QVL_OV_PYTHON", "/work/peers/ov-venv/bin/python"))
    p.add_argument("--ov-dir", default=env("QVL_OV_DIR"))
    p.add_argument("--hf-python", default=env("QVL_HF_PYTHON", sys.executable))
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--warm-image", help=argparse.SUPPRESS)
    args = p.parse_args()
    common.stop_on_sigterm()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    home = os.path.dirname(os.path.abspath(args.model))
    args.gguf_dir = args.gguf_dir or os.path.join(home, "gguf")
    args.ov_dir = args.ov_dir or os.path.join(home, "ov")
    engines, skipped = [], {}
    for e in select(args):
        why = e.missing(args)
        if why:
            skipped[e.label] = why
            print(f"skipping {e.label}: {why}", file=sys.stderr)
        else:
            engines.append(e)
    with tempfile.TemporaryDirectory(prefix="qvl-performance-") as folder:
        results = run_rounds(args, engines, write_images(args, folder))
    heading = common.cpu_class()
    body = section(args, engines, results, skipped)
    print(f"\n## {heading}\n\n{body}")
    common.write_section(args.out, heading, body, HEADER)
    if args.plot:
        plot(args.plot, engines, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": heading, "args": vars(args), "results": results, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
