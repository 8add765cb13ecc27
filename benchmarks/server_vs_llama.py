"""`qvl serve` against llama.cpp's llama-server, both batching N streams at once: N clients each
send one streamed chat request with a distinct text prompt and get exactly T tokens back
(ignore_eos), all at once; aggregate completion tokens per second over the wall time, and the
median time to first token. One server runs at a time (started, warmed with one request,
measured, stopped); the order alternates over R rounds, and the qvl / llama.cpp ratio is each
round's own. llama-server and the GGUF: benchmarks/README.md.

    python benchmarks/server_vs_llama.py --model /work/ckpt/qvl-2b --gguf /work/ckpt/gguf/qvl-2b-Q8_0.gguf \
        --llama-server /work/peers/llama/build/bin/llama-server --streams 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx

import common


def start(kind: str, args: argparse.Namespace, port: int) -> subprocess.Popen:
    if kind == "qvl":
        cmd = [sys.executable, "-m", "qvl.cli", "serve", "--model", args.model, "--port", str(port),
               "--threads", str(args.threads), "--max-batch", str(args.streams), "--log-level", "warning",
               "--prefix-cache-mb", "0", "--answer-cache", "0"]
    else:
        cmd = [args.llama_server, "-m", args.gguf, "--port", str(port), "-t", str(args.threads), "-np", str(args.streams),
               "-c", str(args.streams * 512), "--jinja", "--no-webui", "-lv", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"{kind} server exited with {proc.returncode}"
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{kind} server not ready in 300 s")


def stream(client: httpx.Client, url: str, prompt: str, tokens: int, out: list, lock: threading.Lock) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started, first, pieces, usage = time.perf_counter(), None, 0, None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                pieces += 1
                first = first or time.perf_counter()
    with lock:
        out.append((usage or pieces, (first or time.perf_counter()) - started))


def measure(client: httpx.Client, url: str, streams: int, tokens: int, tag: str) -> tuple[float, float, int]:
    """(aggregate tokens/s, median TTFT s, total tokens) for `streams` requests at once, over
    `client`'s kept connections (a client made per request put ~20 ms of its set-up inside
    every first token)."""
    out, lock = [], threading.Lock()
    threads = [threading.Thread(target=stream, args=(client, url, f"{tag} stream {i}: tell a long story.", tokens,
                                                     out, lock))
               for i in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    total = sum(n for n, _ in out)
    return total / wall, statistics.median(t for _, t in out), total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/work/ckpt/qvl-2b")
    p.add_argument("--gguf", default="/work/ckpt/gguf/qvl-2b-Q8_0.gguf")
    p.add_argument("--llama-server", default="/work/peers/llama/build/bin/llama-server")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    results: dict[str, list[tuple[float, float, int]]] = {"qvl": [], "llama.cpp": []}
    for rnd in range(args.rounds):
        for kind in (("qvl", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "qvl")):
            port = common.free_port()
            proc = start("qvl" if kind == "qvl" else "llama", args, port)
            limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=args.streams)
            try:
                url = f"http://127.0.0.1:{port}"
                with httpx.Client(timeout=None, limits=limits) as client:
                    measure(client, url, args.streams, 8, f"warm {rnd}")  # every connection opened
                    rate, ttft, total = measure(client, url, args.streams, args.tokens, f"round {rnd}")
            finally:
                proc.terminate()
                proc.wait(60)
            results[kind].append((rate, ttft, total))
            print(f"round {rnd + 1}, {kind}: {rate:.1f} tokens/s over {args.streams} streams ({total} tokens), "
                  f"median first token {ttft:.2f} s", flush=True)
    for kind, values in results.items():
        print(f"{kind}: {common.spread([v[0] for v in values], '{:.1f}')} tokens/s, "
              f"first token {common.spread([v[1] for v in values])} s")
    ratios = [q[0] / lc[0] for q, lc in zip(results["qvl"], results["llama.cpp"])]
    print(f"qvl / llama.cpp aggregate tokens/s, per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
