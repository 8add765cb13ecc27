"""Qwen3.5 (hybrid: Gated DeltaNet and gated full-attention layers) beside its peers on one
checkpoint, every figure measured side by side in one run. Prints markdown tables (and every
round's raw results to --json); writes nothing else.

    PYTHONPATH=src .venv/bin/python benchmarks/qwen3_5.py --model /work/ckpt/qwen35-2b \\
        --gguf-dir /work/ckpt/gguf35 [--parts single,turns,streams,layers,floor] [--rounds 3] [--json out.json]

Parts (--parts, comma-separated; default all five):

single   First token and decode ms/token of one streamed chat request: a --image WIDTHxHEIGHT
         image (512x512: 256 image tokens, the --image-tokens budget in every engine) and
         "Describe this image in detail.", --new-tokens greedy with EOS ignored, thinking off
         (enable_thinking false in the chat template, every engine). qvl int8 and int4 (`qvl
         serve`, caches off), llama.cpp Q8_0 and Q4_0 (llama-server -np 1, prompt cache off),
         transformers bf16 (in process: generate with a streamer stamping each token; preprocessing
         inside the first token). Each engine runs in a fresh process per round, answers a warm-up
         request about another image, then the measured one. First token: from sending the
         request to the first streamed token; decode: (last token's arrival - first's) /
         (completion tokens - 1).
turns    A long shared context: a system prompt holding a document, then the image and a question,
         --turn-prompt-tokens prompt tokens in all (default 4,096), --turn-tokens answer tokens.
         Then, from the same server: (i) a follow-up in that conversation (its answer kept, a new
         question), (ii) a new conversation with the same system prompt and image and another
         question. Caches as each engine ships them (qvl: prefix and vision caches; llama-server:
         its slot, context checkpoints and --cache-ram). Per turn: first token, prompt tokens,
         and how many came from a cache (qvl: the reused_tokens of qvl.timings in its last chunk;
         llama-server: timings.cache_n, and prompt_n processed). transformers keeps nothing
         between calls: each of its turns is a whole prefill.
streams  --streams requests at once, each with its own image and question, --new-tokens each:
         aggregate completion tokens/s over the wall time and the median first token; `qvl serve
         --max-batch N` (int8) against `llama-server -np N` (Q8_0), on this checkpoint and on
         --vl-model (a Qwen3-VL checkpoint, its GGUF in --vl-gguf-dir), so the two qvl/llama.cpp
         ratios (each round's own, median over rounds) can be compared.
layers   qvl int8 in process: the prefill of a --prompt-tokens text prompt (one token answered,
         caches off), forward hooks on every decoder layer's token mixer summed over the prefill:
         ms per Gated DeltaNet layer against ms per full-attention layer, and the mixers' share.
floor    qvl int8 and int4 in one process, their order rotated each round: the machine's read
         rate as `qvl info --model` measures it (qvl.sizing.read_bandwidth), then that format's
         decode of --new-tokens greedy tokens after a short text prompt. The memory-read floor
         is the bytes a decode step reads (qvl.sizing.footprint) over the rate read just before;
         decode / floor per round, and its median.

In single, turns and streams the engines run in an order rotated by one each round (common.py);
the layers and floor parts are one process each, measuring --rounds rounds. GGUF files are looked for as
<dir>/<checkpoint folder>-Q8_0.gguf, -Q4_0.gguf and mmproj-<checkpoint folder>-f16.gguf;
benchmarks/README.md says how they are made. Engines or files missing are skipped with a line
saying so. Timings on a busy machine mean nothing: run it alone on a quiet one.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from performance import checked, last_json  # noqa: E402

PROMPT = "Describe this image in detail."
SYSTEM = "Answer from the document below and the user's image.\n\n"
QUESTIONS = ("Which clauses of the document fit what the image shows?", "Which of those has the largest quantity?",
             "Summarise the delivery terms of the document and relate them to the image.")
PARTS = ("single", "turns", "streams", "layers", "floor")
FLOOR_PROMPT = "Write a long story about a lighthouse keeper."


@dataclass(frozen=True)
class Side:
    """One engine configuration: qvl (serve) with weights int8|int4, llama (llama-server) with a
    GGUF quantisation, or transformers in bf16."""

    key: str
    label: str
    kind: str  # qvl | llama | transformers
    weights: str


SIDES = [Side("qvl-int8", "qvl int8", "qvl", "int8"), Side("qvl-int4", "qvl int4", "qvl", "int4"),
         Side("llama-q8_0", "llama.cpp Q8_0", "llama", "Q8_0"), Side("llama-q4_0", "llama.cpp Q4_0", "llama", "Q4_0"),
         Side("transformers", "transformers bf16", "transformers", "bf16")]


# -- files and processes ---------------------------------------------------------------------------

def gguf_files(model: str, gguf_dir: str, quant: str) -> tuple[str, str]:
    """(model GGUF, mmproj GGUF) of a checkpoint folder's conversions."""
    name = os.path.basename(os.path.normpath(model))
    return os.path.join(gguf_dir, f"{name}-{quant}.gguf"), os.path.join(gguf_dir, f"mmproj-{name}-f16.gguf")


def missing(side: Side, args) -> str | None:
    """Why side cannot run here, or None."""
    if side.kind == "llama":
        paths = [llama_server(args), *gguf_files(args.model, args.gguf_dir, side.weights)]
        return next((f"no {p}" for p in paths if not os.path.exists(p)), None)
    if side.kind == "transformers":
        done = common.run([args.hf_python, "-c", "from transformers import Qwen3_5ForConditionalGeneration"], 300)
        return None if done.returncode == 0 else f"{args.hf_python} cannot import Qwen3_5ForConditionalGeneration"
    return None


def llama_server(args) -> str:
    return os.path.join(args.llama_bin, "llama-server")


def qvl_command(args, model: str, weights: str, port: int, caches: bool, batch: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "qvl.cli", "serve", "--model", model, "--weights", weights, "--threads",
           str(args.threads), "--port", str(port), "--max-image-tokens", str(args.image_tokens), "--log-level", "warning"]
    if batch:
        cmd += ["--max-batch", str(batch), "--queue-size", str(batch)]
    return cmd if caches else cmd + ["--prefix-cache-mb", "0", "--answer-cache", "0", "--vision-cache-mb", "0"]


def llama_command(args, model: str, gguf_dir: str, quant: str, port: int, context: int, slots: int,
                  caches: bool) -> list[str]:
    gguf, mmproj = gguf_files(model, gguf_dir, quant)
    cmd = [llama_server(args), "-m", gguf, "--mmproj", mmproj, "-c", str(context), "-np", str(slots), "-t",
           str(args.threads), "-tb", str(args.threads), "--image-max-tokens", str(args.image_tokens), "--no-webui",
           "--host", "127.0.0.1", "--port", str(port)]
    return cmd if caches else cmd + ["--cache-ram", "0"]


def serve(cmd: list[str], port: int, timeout: float, work):
    """Start the server cmd, wait until it answers /health, return (work(url), its Finished:
    output and peak RSS) after stopping it; a failure carries the server's last lines."""
    server = common.Child(cmd)
    try:
        common.wait_healthy(server, port, timeout)
        result = work(f"http://127.0.0.1:{port}")
    except Exception as e:
        done = server.finish(30, stop=True)
        raise RuntimeError(f"{os.path.basename(cmd[0])} {' '.join(cmd[1:4])}: {e}\n{done.tail()}") from None
    return result, server.finish(30, stop=True)


def worker(args, python: str, name: str, extra: list[str]) -> dict:
    """This script's --worker NAME under `python`, in a fresh process: its JSON line and peak RSS."""
    cmd = [python, os.path.abspath(__file__), "--worker", name, "--model", args.model, "--threads",
           str(args.threads), "--image-tokens", str(args.image_tokens), "--new-tokens", str(args.new_tokens),
           "--turn-tokens", str(args.turn_tokens), "--rounds", str(args.rounds), *extra]
    done = checked(common.run(cmd, args.timeout), cmd)
    return {**last_json(done), "rss": done.peak_rss_bytes}


# -- requests ------------------------------------------------------------------------------------

def thinking_off(model: str) -> dict:
    """The request fields that turn a hybrid template's thinking off (none for other templates)."""
    path = os.path.join(model, "chat_template.jinja")
    has_switch = os.path.exists(path) and "enable_thinking" in open(path).read()
    return {"chat_template_kwargs": {"enable_thinking": False}} if has_switch else {}


def image_part(path: str) -> dict:
    with open(path, "rb") as f:
        return {"type": "image_url", "image_url": {"url": common.data_uri(f.read())}}


@functools.cache
def http() -> httpx.Client:
    """One client for every request, its connections kept as an application keeps them (a client
    made per request put its ~20 ms of TLS set-up inside every first token, on every engine)."""
    return httpx.Client(timeout=None)


def stream_chat(url: str, body: dict, timeout: float) -> dict:
    """One streamed chat completion: ttft_s (from sending), decode_ms per token after the first,
    the answer text, prompt and completion tokens, and prompt tokens taken from a cache (qvl:
    reused_tokens; llama-server: cache_n) with those it processed (llama-server's prompt_n)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    stamps, text, usage, extra = [], [], {}, {}
    client = http()  # (made by the warm-up request, before any timing)
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            extra.update({k: chunk[k] for k in ("qvl", "timings") if chunk.get(k)})  # qvl's / llama-server's own
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    stamps.append(time.perf_counter())
                    text.append(delta.get("content") or "")
    if not stamps:
        raise RuntimeError("no token streamed")
    n = usage.get("completion_tokens", len(stamps))
    if "qvl" in extra:
        cached, processed = extra["qvl"]["timings"]["reused_tokens"], None
    else:
        cached, processed = extra.get("timings", {}).get("cache_n"), extra.get("timings", {}).get("prompt_n")
    return {"ttft_s": stamps[0] - started, "decode_ms": (stamps[-1] - stamps[0]) / max(1, n - 1) * 1000,
            "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": n,
            "cached_tokens": cached, "processed_tokens": processed}


def chat_body(messages: list[dict], tokens: int, model: str, cache: bool) -> dict:
    return {"model": "m", "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": cache, **thinking_off(model)}


def turn_messages(document: str, image: dict, turn: str, answer: str = "") -> list[dict]:
    """The messages of a turn: first (system document, image and a question), follow-up (the
    first with its answer and a new question) or new (the same system and image, another question)."""
    system = {"role": "system", "content": SYSTEM + document}
    first = {"role": "user", "content": [image, {"type": "text", "text": QUESTIONS[0]}]}
    if turn == "first":
        return [system, first]
    if turn == "follow-up":
        return [system, first, {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
    return [system, {"role": "user", "content": [image, {"type": "text", "text": QUESTIONS[2]}]}]


TURNS = ("first", "follow-up", "new")
GOODS = ("copper wire", "steel bolts", "glass panels", "oak planks", "wool blankets", "rice sacks", "solar cells",
         "paint tins", "rubber hoses", "ceramic tiles")
PLACES = ("northern depot", "harbour warehouse", "river station", "mountain store", "city workshop", "airfield hangar")


def document(tokens: int, tokenizer, seed: int = 0) -> str:
    """A contract-like text of about `tokens` tokens (counted by tokenizer.encode), varied enough
    that no two sentences repeat."""
    rng, lines, count = random.Random(seed), [], 0
    while count < tokens:
        line = (f"Clause {len(lines) + 1}: the supplier delivers {rng.randint(2, 900)} crates of "
                f"{rng.choice(GOODS)} to the {rng.choice(PLACES)} on day {rng.randint(1, 365)}, "
                f"paid {rng.randint(10, 99)}.{rng.randint(0, 99):02d} per crate within {rng.randint(5, 60)} days.\n")
        count += len(tokenizer.encode(line))
        lines.append(line)
    return "".join(lines)


# -- the parts: one round of one side --------------------------------------------------------------

def single_round(side: Side, args, files: dict) -> dict:
    if side.kind == "transformers":
        return worker(args, args.hf_python, "single", ["--image", files["image"], "--warm-image", files["warm"]])

    def work(url):
        ask = [image_part(files["warm"]), {"type": "text", "text": PROMPT}]
        stream_chat(url, chat_body([{"role": "user", "content": ask}], 4, args.model, False), args.timeout)
        ask[0] = image_part(files["image"])
        return stream_chat(url, chat_body([{"role": "user", "content": ask}], args.new_tokens, args.model, False),
                           args.timeout)

    return serve_side(side, args, False, 4096, work)


def turns_round(side: Side, args, files: dict) -> dict:
    """{turn: stream_chat's result} for the three turns, in order, from one process."""
    if side.kind == "transformers":
        return worker(args, args.hf_python, "turns", ["--image", files["image"], "--doc", files["doc"]])
    doc, image = open(files["doc"]).read(), image_part(files["image"])

    def work(url):
        out, answer = {}, ""
        for turn in TURNS:
            body = chat_body(turn_messages(doc, image, turn, answer), args.turn_tokens, args.model, True)
            out[turn] = stream_chat(url, body, args.timeout)
            answer = answer or out[turn]["text"]
        return out

    return serve_side(side, args, True, 2 * (args.turn_prompt_tokens + args.turn_tokens), work)


def serve_side(side: Side, args, caches: bool, context: int, work) -> dict:
    """work(url) against side's server (qvl serve, or llama-server with one slot of `context`
    tokens) on this checkpoint, with its peak RSS."""
    port = common.free_port()
    if side.kind == "qvl":
        cmd = qvl_command(args, args.model, side.weights, port, caches)
    else:
        cmd = llama_command(args, args.model, args.gguf_dir, side.weights, port, context, 1, caches)
    result, done = serve(cmd, port, args.timeout, work)
    return {**result, "rss": done.peak_rss_bytes}


def streams_round(kind: str, model: str, gguf_dir: str, args, files: dict) -> dict:
    """qvl (int8) or llama (Q8_0) answering --streams requests at once: aggregate tokens/s."""
    n, port = args.streams, common.free_port()
    if kind == "qvl":
        cmd = qvl_command(args, model, "int8", port, caches=False, batch=n)
    else:
        cmd = llama_command(args, model, gguf_dir, "Q8_0", port, n * (args.image_tokens + args.new_tokens + 128), n,
                            caches=False)

    def ask(url, i: int, tokens: int) -> dict:
        content = [image_part(files["streams"][i]), {"type": "text", "text": f"Stream {i}: {PROMPT}"}]
        return stream_chat(url, chat_body([{"role": "user", "content": content}], tokens, model, False), args.timeout)

    def work(url):
        ask(url, n, 4)  # warm-up, on an image of its own
        started = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda i: ask(url, i, args.new_tokens), range(n)))
        wall = time.perf_counter() - started
        tokens = sum(r["completion_tokens"] for r in results)
        return {"tokens_per_s": tokens / wall, "ttft_s": statistics.median(r["ttft_s"] for r in results),
                "tokens": tokens, "wall_s": wall}

    result, done = serve(cmd, port, args.timeout, work)
    return {**result, "rss": done.peak_rss_bytes}


# -- workers: a fresh process each, one JSON line on stdout ---------------------------------------

def transformers_session(args):
    """transformers' Qwen3.5 in bf16 and ask(messages, image path, tokens) -> a result shaped
    like stream_chat's: the checkpoint's template (thinking off), its image processor (PIL backend: the
    processor class wants torchvision), greedy generate with EOS ignored."""
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3_5ForConditionalGeneration

    torch.set_num_threads(args.threads)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    images = AutoImageProcessor.from_pretrained(args.model, backend="pil")
    limits = {"shortest_edge": images.size["shortest_edge"],
              "longest_edge": args.image_tokens * (images.patch_size * images.merge_size) ** 2}
    pad = "<|image_pad|>"
    pad_id = tokenizer.convert_tokens_to_ids(pad)

    def ask(messages: list[dict], image: str, tokens: int) -> dict:
        stamps = common.TokenStamps()
        started = time.perf_counter()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
        pixels = images(images=[Image.open(image).convert("RGB")], size=limits, return_tensors="pt")
        n_image = int(pixels["image_grid_thw"].prod()) // images.merge_size ** 2
        ids = tokenizer(text.replace(pad, pad * n_image), return_tensors="pt")["input_ids"]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad_id).int(),
                  **pixels}
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 streamer=stamps)
        new = out[0, ids.shape[1]:]
        return {"ttft_s": stamps.times[0] - started,
                "decode_ms": (stamps.times[-1] - stamps.times[0]) / max(1, len(stamps.times) - 1) * 1000,
                "text": tokenizer.decode(new, skip_special_tokens=True), "prompt_tokens": ids.shape[1],
                "completion_tokens": len(new), "cached_tokens": 0, "processed_tokens": ids.shape[1],
                "image_tokens": n_image}

    return ask, f"transformers {transformers.__version__}"


def single_worker(args) -> dict:
    ask, version = transformers_session(args)
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    ask(user, args.warm_image, 4)
    return {**ask(user, args.image, args.new_tokens), "version": version}


def turns_worker(args) -> dict:
    ask, version = transformers_session(args)
    doc, out, answer = open(args.doc).read(), {}, ""
    for turn in TURNS:
        out[turn] = ask(turn_messages(doc, {"type": "image"}, turn, answer), args.image, args.turn_tokens)
        answer = answer or out[turn]["text"]
    return {**out, "version": version}


def layers_worker(args) -> dict:
    """qvl int8 in this process: per prompt, the seconds each kind of token mixer took in the
    prefill (summed over layers and calls), the prefill's own, and the layer counts."""
    from qvl.engine import Engine, EngineOptions
    from qvl.requests import Request
    from qvl.sampling import SamplingParams

    engine = Engine.load(EngineOptions(model=args.model, weights="int8", threads=args.threads, prefix_cache_mb=0,
                                       answer_cache_entries=0, vision_cache_mb=0))
    engine.warm_up()
    spent, began, counts = {"linear": 0.0, "full": 0.0}, {}, {"linear": 0, "full": 0}
    for layer in engine.model.language_model.layers:
        kind, mixer = ("linear", layer.linear_attn) if hasattr(layer, "linear_attn") else ("full", layer.self_attn)
        counts[kind] += 1
        mixer.register_forward_pre_hook(lambda m, _: began.__setitem__(m, time.perf_counter()))
        mixer.register_forward_hook(
            lambda m, _, __, kind=kind: spent.__setitem__(kind, spent[kind] + time.perf_counter() - began.pop(m)))
    switches = thinking_off(args.model).get("chat_template_kwargs", {})
    rounds = []
    for r in range(args.rounds):
        text = document(args.prompt_tokens, engine.tokenizer, seed=100 + r)  # a new prompt each round
        request = Request([{"role": "user", "content": text}], SamplingParams(max_new_tokens=1),
                          template_kwargs=switches)
        spent.update(linear=0.0, full=0.0)
        started = time.perf_counter()
        done = engine.generate(request)
        wall = time.perf_counter() - started
        rounds.append({"linear_s": spent["linear"], "full_s": spent["full"], "ttft_s": wall,
                       "prefill_ms": done.timings.prefill_ms, "prompt_tokens": done.usage.prompt_tokens})
    return {"counts": counts, "rounds": rounds, "model_id": engine.model_id}


def floor_worker(args) -> dict:
    """qvl int8 and int4 in this process: per round and format (order rotated), the read rate
    (bytes/s) measured just before that format's decode ms/token; the bytes a step reads."""
    from qvl.config import ModelConfig
    from qvl.engine import Engine, EngineOptions
    from qvl.requests import Request
    from qvl.sampling import SamplingParams
    from qvl.sizing import footprint, read_bandwidth

    cfg = ModelConfig.from_file(os.path.join(args.model, "config.json"))
    engines = {w: Engine.load(EngineOptions(model=args.model, weights=w, threads=args.threads, prefix_cache_mb=0,
                                            answer_cache_entries=0, vision_cache_mb=0)) for w in ("int8", "int4")}
    switches = thinking_off(args.model).get("chat_template_kwargs", {})
    request = Request([{"role": "user", "content": FLOOR_PROMPT}],
                      SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True),
                      template_kwargs=switches)
    for engine in engines.values():
        engine.generate(request)  # warm-up
    rounds = []
    for r, order in common.rotations(list(engines), args.rounds):
        for w in order:
            rate = read_bandwidth()
            rounds.append({"round": r, "weights": w, "read_bytes_per_s": rate,
                           "decode_ms": engines[w].generate(request).timings.decode_ms_per_token})
            print(f"round {r + 1}, qvl {w}: read {rate / 1e9:.1f} GB/s, decode {rounds[-1]['decode_ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    return {"step_bytes": {w: footprint(cfg, w).read_per_token for w in engines}, "rounds": rounds}


WORKERS = {"single": single_worker, "turns": turns_worker, "layers": layers_worker, "floor": floor_worker}


# -- the run and the tables ------------------------------------------------------------------------

def write_files(args, folder: str) -> dict:
    """The measured image, the warm-up's, one per stream (and the warm-up stream's), the turns'
    document: all different, so that no engine reuses another request's work."""
    from qvl.bench import parse_size, synthetic_image
    from qvl.processing.tokenizer import Tokenizer

    w, h = parse_size(args.image)

    def image(name: str, seed: int) -> str:
        path = os.path.join(folder, f"{name}.png")
        synthetic_image(w, h, seed).save(path)
        return path

    files = {"image": image("measured", 0), "warm": image("warm", 1),
             "streams": [image(f"stream{i}", 10 + i) for i in range(args.streams + 1)],
             "doc": os.path.join(folder, "document.txt")}
    # the first turn's prompt: the document, the image and ~40 tokens of template and question
    doc_tokens = args.turn_prompt_tokens - args.image_tokens - 40
    with open(files["doc"], "w") as f:
        f.write(document(doc_tokens, Tokenizer.from_dir(args.model)))
    return files


def run_sides(names: list[str], measure, rounds: int, label) -> dict:
    """{name: [(round, result) ...]}, the names in an order rotated each round; a failure is
    printed and the rest go on."""
    results = {name: [] for name in names}
    for r, order in common.rotations(names, rounds):
        for name in order:
            try:
                res = measure(name)
            except Exception as e:  # noqa: BLE001 - a failed round is reported, the others go on
                print(f"round {r + 1}, {label(name)}: FAILED {e}", file=sys.stderr, flush=True)
                continue
            results[name].append((r, res))
            print(f"round {r + 1}, {label(name)}: {summary(res)}", flush=True)
    return results


def summary(res: dict) -> str:
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()
             if k not in ("text", "version", "model_id") and not isinstance(v, (dict, list))}
    nested = {k: summary(v) for k, v in res.items() if isinstance(v, dict)}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) + "".join(f"; {k}: [{v}]" for k, v in nested.items())


def paired(results: dict, key: str, base: str, value) -> str:
    """The median over rounds of value(key's result) / value(base's result), both from the same round."""
    mine, theirs = dict(results.get(key, [])), dict(results.get(base, []))
    common_rounds = sorted(set(mine) & set(theirs))
    if not common_rounds:
        return "-"
    return f"{statistics.median(value(mine[r]) / value(theirs[r]) for r in common_rounds):.2f}x"


def single_table(sides: list[Side], results: dict) -> str:
    rows = []
    for s in sides:
        got = [res for _, res in results[s.key]]
        if got:
            rows.append([s.label, common.spread([g["ttft_s"] for g in got]),
                         paired(results, s.key, "qvl-int8", lambda g: g["ttft_s"]),
                         common.spread([g["decode_ms"] for g in got], "{:.1f}"),
                         paired(results, s.key, "qvl-int8", lambda g: g["decode_ms"]),
                         got[-1]["prompt_tokens"], f"{max(g['rss'] for g in got) / 1e9:.2f}"])
    return common.markdown_table(["engine", "first token (s)", "vs qvl int8", "decode ms/token", "vs qvl int8",
                                  "prompt tokens", "peak RSS (GB)"], rows)


def turns_table(sides: list[Side], results: dict) -> str:
    rows = []
    for s in sides:
        got = [res for _, res in results[s.key]]
        for turn in TURNS if got else ():
            last = got[-1][turn]
            reused = "-" if last["cached_tokens"] is None else str(last["cached_tokens"])
            if last["processed_tokens"] is not None:
                reused += f" (processed {last['processed_tokens']})"
            rows.append([s.label, turn, common.spread([g[turn]["ttft_s"] for g in got]),
                         paired(results, s.key, "qvl-int8", lambda g, t=turn: g[t]["ttft_s"]),
                         last["prompt_tokens"], reused])
    return common.markdown_table(["engine", "turn", "first token (s)", "vs qvl int8", "prompt tokens",
                                  "from cache (last round)"], rows)


def streams_table(results: dict, models: dict) -> str:
    rows = []
    for m in models:
        for kind in ("qvl", "llama"):
            got = [res for _, res in results.get(f"{m}/{kind}", [])]
            if got:
                rows.append([f"{m}: {'qvl int8' if kind == 'qvl' else 'llama.cpp Q8_0'}",
                             common.spread([g["tokens_per_s"] for g in got], "{:.1f}"),
                             common.spread([g["ttft_s"] for g in got]),
                             paired(results, f"{m}/qvl", f"{m}/llama", lambda g: g["tokens_per_s"])
                             if kind == "qvl" else ""])
    return common.markdown_table(["checkpoint: engine", "aggregate tokens/s", "median first token (s)",
                                  "qvl / llama.cpp tokens/s"], rows)


def layers_table(result: dict) -> str:
    counts, rounds = result["counts"], result["rounds"]
    per = {k: [r[f"{k}_s"] / counts[k] * 1000 for r in rounds] for k in counts if counts[k]}
    rows = [[name, counts[k], common.spread(per[k], "{:.1f}"),
             common.spread([r[f"{k}_s"] / r["ttft_s"] * 100 for r in rounds], "{:.0f}")]
            for k, name in (("linear", "Gated DeltaNet"), ("full", "full attention")) if k in per]
    table = common.markdown_table(["token mixer", "layers", "ms per layer (prefill)", "% of first token"], rows)
    ratio = (f"Gated DeltaNet / full attention, per layer: "
             f"{statistics.median(a / b for a, b in zip(per['linear'], per['full'])):.2f}x"
             if len(per) == 2 else "")
    first = common.spread([r["ttft_s"] for r in rounds])
    return f"{table}\n\n{ratio}; prompt {rounds[-1]['prompt_tokens']} tokens, first token {first} s."


def floor_table(result: dict) -> str:
    rows = []
    for w, step in result["step_bytes"].items():
        got = [r for r in result["rounds"] if r["weights"] == w]
        floors = [step / r["read_bytes_per_s"] * 1000 for r in got]
        rows.append([f"qvl {w}", f"{step / 1e9:.2f}", common.spread([r["read_bytes_per_s"] / 1e9 for r in got], "{:.1f}"),
                     common.spread(floors, "{:.1f}"), common.spread([r["decode_ms"] for r in got], "{:.1f}"),
                     common.spread([r["decode_ms"] / f for r, f in zip(got, floors)])])
    return common.markdown_table(["weights", "a step reads (GB)", "read rate (GB/s)", "floor (ms)",
                                  "decode (ms/token)", "decode / floor"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/work/ckpt/qwen35-2b", help="a Qwen3.5 checkpoint folder")
    p.add_argument("--gguf-dir", default="/work/ckpt/gguf35", help="its GGUF conversions")
    p.add_argument("--vl-model", default="/work/ckpt/qvl-2b", help="streams: the Qwen3-VL checkpoint compared")
    p.add_argument("--vl-gguf-dir", default="/work/ckpt/gguf", help="streams: its GGUF conversions")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--engines", default=",".join(s.key for s in SIDES),
                   help="single and turns: comma-separated, of " + ", ".join(s.key for s in SIDES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image", default="512x512", help="the synthetic images, WIDTHxHEIGHT")
    p.add_argument("--image-tokens", type=int, default=256, help="every engine's image budget, in LLM tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="single and streams: tokens per answer")
    p.add_argument("--turn-prompt-tokens", type=int, default=4096, help="turns: the first turn's prompt tokens")
    p.add_argument("--turn-tokens", type=int, default=32, help="turns: tokens per answer")
    p.add_argument("--streams", type=int, default=8, help="streams: requests at once")
    p.add_argument("--prompt-tokens", type=int, default=4000, help="layers: the text prompt's tokens")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one engine's round may take")
    p.add_argument("--llama-bin", default=os.environ.get("QVL_LLAMA_BIN", "/work/peers/llama/build/bin"))
    p.add_argument("--hf-python", default=os.environ.get("QVL_HF_PYTHON", sys.executable),
                   help="an interpreter with transformers >= 5.2 (Qwen3.5)")
    p.add_argument("--json", help="also write every round's raw results here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--warm-image", help=argparse.SUPPRESS)
    p.add_argument("--doc", help=argparse.SUPPRESS)
    args = p.parse_args()
    common.stop_on_sigterm()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    parts, keys = args.parts.split(","), args.engines.split(",")
    unknown = (set(parts) - set(PARTS)) | (set(keys) - {s.key for s in SIDES})
    if unknown:
        raise SystemExit(f"unknown part or engine: {', '.join(sorted(unknown))} (see --help)")
    sides = []
    for s in SIDES if {"single", "turns"} & set(parts) else ():
        why = missing(s, args) if s.key in keys else None
        if s.key in keys and why:
            print(f"skipping {s.label}: {why}", file=sys.stderr)
        elif s.key in keys:
            sides.append(s)
    by_key, label = {s.key: s for s in sides}, lambda key: by_key[key].label
    out, raw = [f"{common.cpu_class()}; {args.threads} threads, {args.rounds} rounds; checkpoint {args.model}."], {}
    with tempfile.TemporaryDirectory(prefix="qvl-qwen3_5-") as folder:
        files = write_files(args, folder)
        if "single" in parts:
            raw["single"] = run_sides(list(by_key), lambda k: single_round(by_key[k], args, files), args.rounds, label)
            out += [f"\n### One request: a {args.image} image, {args.new_tokens} tokens\n", single_table(sides, raw["single"])]
        if "turns" in parts:
            raw["turns"] = run_sides(list(by_key), lambda k: turns_round(by_key[k], args, files), args.rounds, label)
            out += [f"\n### Turns: a {args.turn_prompt_tokens}-token first turn (document, image, question), "
                    f"a follow-up, a new conversation; {args.turn_tokens} tokens each\n",
                    turns_table(sides, raw["turns"])]
        if "streams" in parts:
            models = {os.path.basename(args.model): (args.model, args.gguf_dir),
                      os.path.basename(args.vl_model): (args.vl_model, args.vl_gguf_dir)}
            names = []
            for m, (model, gguf_dir) in models.items():
                need = {"qvl": [model], "llama": [llama_server(args), *gguf_files(model, gguf_dir, "Q8_0")]}
                for kind, paths in need.items():
                    absent = [p for p in paths if not os.path.exists(p)]
                    if absent:
                        print(f"skipping {m}/{kind}: no {absent[0]}", file=sys.stderr)
                    else:
                        names.append(f"{m}/{kind}")

            def measure(name):
                m, kind = name.split("/")
                return streams_round(kind, *models[m], args, files)

            raw["streams"] = run_sides(names, measure, args.rounds, str)
            out += [f"\n### {args.streams} streams at once, each its own {args.image} image, {args.new_tokens} "
                    "tokens\n", streams_table(raw["streams"], models)]
        if "layers" in parts:
            raw["layers"] = worker(args, sys.executable, "layers", ["--prompt-tokens", str(args.prompt_tokens)])
            out += [f"\n### qvl int8 prefill of a {args.prompt_tokens}-token text prompt, by token mixer\n",
                    layers_table(raw["layers"])]
        if "floor" in parts:
            raw["floor"] = worker(args, sys.executable, "floor", [])
            out += [f"\n### qvl's decode against its memory-read floor, {args.new_tokens} tokens\n",
                    floor_table(raw["floor"])]
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": common.cpu_class(), "args": vars(args), "results": raw}, f, indent=1)


if __name__ == "__main__":
    main()
