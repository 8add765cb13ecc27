"""qvl and llama.cpp on a machine another program shares: the time to the first token and decode
ms per token quiet, beside one CPU-bound process ("busy": a spin loop at normal priority, a
laptop's other program), beside a CPU-bound process at nice 19 ("nice": a background job) and
beside a build at nice 19 ("compile": qvl's C sources compiled over and over);
each loaded figure over the quiet one of the same server in the same round.

    python benchmarks/busy.py --model /work/ckpt/qvl-2b --gguf /work/ckpt/gguf/qvl-2b-Q8_0.gguf \\
        --mmproj /work/ckpt/gguf/mmproj-qvl-2b-f16.gguf --llama-bin /work/peers/llama/build/bin --rounds 5

The workload: a photo-like image of --image-tokens tokens (a new one for every request, so no
cache answers it) and "Describe this image in detail.", greedy, --tokens tokens with EOS ignored,
streamed over HTTP: first token from the request to the first streamed token, decode (last token
- first) / (tokens - 1). Each round starts each server in turn (the order alternating), warms it
with one request, then measures it quiet, busy, nice and compile in an order rotated every round,
the load started --settle seconds before the request and stopped after it. The load is one process
(the compile: one compiler at a time; --load-cpu pins it to a CPU; by default the scheduler
places it). qvl runs with its default threads (torch's own ops then follow the load;
--qvl-threads fixes them), llama.cpp with -t/-tb --threads. The table gives each figure's median
over rounds with its min-max spread, and each ratio's (loaded / quiet, per round). Engines it does
not find are skipped with a line saying so.

Check it with a tiny checkpoint (`qvl synth /tmp/tiny --preset tiny`): `--model /tmp/tiny
--engines qvl --rounds 1 --tokens 8 --settle 0.5`; time it only on a machine nothing else runs on.
"""

from __future__ import annotations

import argparse
import base64
import glob
import io
import json
import os
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

PROMPT = "Describe this image in detail."
REPO = os.path.dirname(HERE)
LOADS = ("quiet", "busy", "nice", "compile")


def qvl_command(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "qvl.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-image-tokens", str(args.image_tokens), "--prefix-cache-mb", "0", "--answer-cache", "0",
           "--vision-cache-mb", "0", "--log-level", "warning"]
    return cmd + (["--threads", str(args.qvl_threads)] if args.qvl_threads else [])


def llama_command(args, port: int) -> list[str]:
    return [os.path.join(args.llama_bin, "llama-server"), "-m", args.gguf, "--mmproj", args.mmproj, "-c", "4096",
            "-t", str(args.threads), "-tb", str(args.threads), "--image-max-tokens", str(args.image_tokens),
            "-np", "1", "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]


def missing(args, engine: str) -> str | None:
    """Why `engine` cannot run here, or None."""
    if engine == "qvl":
        return None
    for path in (os.path.join(args.llama_bin, "llama-server"), args.gguf, args.mmproj):
        if not path or not os.path.exists(path):
            return f"{path or 'a GGUF (--gguf, --mmproj)'} not found"
    return None


def image_uri(width: int, seed: int) -> str:
    from qvl.bench import synthetic_image

    buf = io.BytesIO()
    synthetic_image(width, width, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(engine: str, port: int, image: str, tokens: int, timeout: float) -> dict:
    """One streamed chat request: first token s, decode ms per token, tokens."""
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                                    {"type": "text", "text": PROMPT}]}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if engine == "llama.cpp":
        body["cache_prompt"] = False
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = last = None
    count = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
    if first is None or count < 2:
        raise RuntimeError(f"the answer streamed {count} tokens")
    return {"ttft_s": first - started, "decode_ms": (last - first) * 1000 / (count - 1), "tokens": count}


def start_load(kind: str, cpu: int | None) -> common.Child | None:
    """The background load: one spin loop at normal priority (busy) or at nice 19 (nice), or a
    compile at nice 19 (compile: qvl's C sources compiled one after the other, over and over, as
    a developer's build beside the model)."""
    if kind == "quiet":
        return None
    if kind == "compile":
        sources = " ".join(sorted(glob.glob(os.path.join(REPO, "src", "qvl", "csrc", "*.c"))))
        compile_one = 'cc -O2 -march=native -fopenmp -c "$f" -o /dev/null || exit 1'
        script = f"while true; do for f in {sources}; do {compile_one}; done; done"
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        return common.Child([*pin, "nice", "-n", "19", "sh", "-c", script])
    code = "import os\n"
    code += f"os.sched_setaffinity(0, {{{cpu}}})\n" if cpu is not None else ""
    code += "os.nice(19)\n" if kind == "nice" else ""
    return common.Child([sys.executable, "-c", code + "while True: pass"])


def measure_server(args, engine: str, order: list[str], seed: int) -> dict[str, dict]:
    """One round of one engine: its server started and warmed, then each load of `order`."""
    port = common.free_port()
    cmd = qvl_command(args, port) if engine == "qvl" else llama_command(args, port)
    server = common.Child(cmd, env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}, cwd=REPO)
    out = {}
    try:
        try:
            common.wait_healthy(server, port, args.timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{engine}: {e}\n{server.finish(5).tail()}") from None
        ask(engine, port, image_uri(args.image_size, seed), min(args.tokens, 8), args.timeout)
        for i, kind in enumerate(order):
            load = start_load(kind, args.load_cpu)
            try:
                time.sleep(args.settle if load else 0)
                out[kind] = ask(engine, port, image_uri(args.image_size, seed + 1 + i), args.tokens, args.timeout)
            finally:
                if load:
                    load.finish(5, stop=True)
            time.sleep(args.settle / 2)
    finally:
        server.finish(30, stop=True)
    return out


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: per engine and figure, the quiet median and each load's ratio (median of the
    rounds' own ratios, with their spread)."""
    rows = []
    for engine, rounds in results.items():
        if not rounds:
            continue
        for key, label, fmt in (("ttft_s", "first token (s)", "{:.2f}"), ("decode_ms", "decode (ms/token)", "{:.1f}")):
            quiet = [r["quiet"][key] for r in rounds]
            cells = [common.spread(quiet, fmt)]
            for kind in LOADS[1:]:
                cells.append(common.spread([r[kind][key] / r["quiet"][key] for r in rounds], "{:.2f}") + "x")
            rows.append([engine, label, *cells])
    return common.markdown_table(["engine", "figure", "quiet", *(f"{kind} / quiet" for kind in LOADS[1:])], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/work/ckpt/qvl-2b")
    p.add_argument("--gguf", default="/work/ckpt/gguf/qvl-2b-Q8_0.gguf")
    p.add_argument("--mmproj", default="/work/ckpt/gguf/mmproj-qvl-2b-f16.gguf")
    p.add_argument("--llama-bin", default=os.environ.get("QVL_LLAMA_BIN", "/work/peers/llama/build/bin"))
    p.add_argument("--engines", default="qvl,llama.cpp", help="comma-separated: qvl, llama.cpp")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--image-tokens", type=int, default=256, help="each engine's image budget")
    p.add_argument("--image-size", type=int, default=512, help="the square image's side in pixels")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t/-tb (default: every CPU)")
    p.add_argument("--qvl-threads", type=int, help="qvl's --threads (default: its own choice, which follows the load)")
    p.add_argument("--load-cpu", type=int, help="pin the load to this CPU (default: not pinned)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds the load runs before a request")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    common.stop_on_sigterm()
    engines = []
    for engine in args.engines.split(","):
        if engine not in ("qvl", "llama.cpp"):
            raise SystemExit(f"--engines: unknown {engine} (choose from qvl, llama.cpp)")
        why = missing(args, engine)
        if why:
            print(f"skipping {engine}: {why}", flush=True)
        else:
            engines.append(engine)
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for r, order in common.rotations(engines, args.rounds):
        loads = list(LOADS[r % 3:] + LOADS[: r % 3])
        for engine in order:
            got = measure_server(args, engine, loads, seed=100 * r)
            results[engine].append(got)
            print(f"round {r + 1}, {engine}: " + ", ".join(
                f"{kind} {got[kind]['ttft_s']:.2f} s + {got[kind]['decode_ms']:.1f} ms/token" for kind in LOADS),
                flush=True)
    print()
    print(f"{common.cpu_class()}, {os.cpu_count()} CPUs; rounds: {args.rounds}; the load "
          + (f"pinned to CPU {args.load_cpu}" if args.load_cpu is not None else "not pinned"))
    print()
    print(table(results))
    if len(engines) == 2:
        for kind in LOADS[1:]:
            for key, label in (("ttft_s", "first token"), ("decode_ms", "decode")):
                ratio = {e: statistics.median(x[kind][key] / x["quiet"][key] for x in results[e]) for e in engines}
                print(f"{kind}: {label} {ratio['qvl']:.2f}x quiet for qvl, {ratio['llama.cpp']:.2f}x for llama.cpp")


if __name__ == "__main__":
    main()
