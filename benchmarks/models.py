"""Several models in one `qvl serve` (a subprocess; its own flags after `--`):

- **switching**: two models loaded (the first two --model), R rounds; in each, the same N
  distinct text requests (T tokens each, streamed, greedy, ignore_eos) sent one at a time
  either to one model in a row then the other ("each alone"), or to the two in turn
  ("alternating"); the two sides' order rotates every round. Seconds per request, and the
  median of the rounds' own alternating / alone ratios.
- **load**: the first model's time to first token right after it was unloaded (Ollama's
  keep_alive 0), against the same request's once loaded: what loading costs beyond the first
  token, with the quantised copy in qvl's cache and the files in the page cache.
- **memory**: three models (the three --model) under --max-loaded 2, requested in turn; the
  server's resident memory with two loaded, then after the third was asked for (the least
  recently used unloaded), each measured once the server has idled; the ratio per request,
  and against the first two's footprint.

Give different checkpoints (e.g. `qvl synth DIR --preset 2b --seed 1`, 2, 3): the same one
under several names maps the same quantised file, whose pages count once in memory.

    python benchmarks/models.py --model /work/ckpt/qvl-2b --model /work/ckpt/qvl-2b-s1 \\
        --model /work/ckpt/qvl-2b-s2 [--parts switching,load,memory] [-- --threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

import common

NAMES = ("a", "b", "c")
SETTLE_S = 3.0  # after the last answer: the worker's idle release (1 s) and an unload's collection have run


class Server:
    """`qvl serve` with the models called a, b, c (kept loaded unless a limit says otherwise)."""

    def __init__(self, models: list[str], extra: list[str]):
        port = common.free_port()
        self.url = f"http://127.0.0.1:{port}"
        given = [arg for name, model in zip(NAMES, models) for arg in ("--model", f"{name}={model}")]
        self.child = common.Child([sys.executable, "-m", "qvl.cli", "serve", *given, "--port", str(port),
                                   "--keep-alive", "-1", "--answer-cache", "0", "--log-level", "warning", *extra])
        self.client = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + 300
        while not self._up():
            if not self.child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"qvl serve did not start:\n{self.child.finish(5, stop=True).tail()}")
            time.sleep(0.2)

    def _up(self) -> bool:
        try:
            return self.client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def ask(self, model: str, i: int, tokens: int) -> tuple[float, float]:
        """(time to first token, total) in seconds of one streamed request."""
        body = {"model": model, "messages": [{"role": "user", "content": f"Request {i}: describe a red bicycle."}],
                "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        started, first = time.perf_counter(), None
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.perf_counter()
        return (first or time.perf_counter()) - started, time.perf_counter() - started

    def loaded(self) -> list[str]:
        return sorted(m["name"].removesuffix(":latest") for m in self.client.get("/api/ps").json()["models"])

    def held(self) -> int:
        """The bytes /api/ps says the loaded models hold."""
        return sum(m["size"] for m in self.client.get("/api/ps").json()["models"])

    def unload(self, model: str) -> None:
        self.client.post("/api/generate", json={"model": model, "keep_alive": 0}).raise_for_status()
        while model in self.loaded():
            time.sleep(0.05)

    def rss(self) -> int:
        with open(f"/proc/{self.child.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def stop(self) -> None:
        self.client.close()
        self.child.finish(30, stop=True)


def switching(args: argparse.Namespace) -> None:
    server = Server(args.model[:2], args.serve)
    try:
        for name in NAMES[:2]:
            server.ask(name, 0, args.tokens)  # loaded, warm

        def run(order: list[str]) -> float:
            started = time.perf_counter()
            for i, name in enumerate(order):
                server.ask(name, i, args.tokens)
            return (time.perf_counter() - started) / len(order)

        n = args.requests
        sides = {"each alone": lambda: run(["a"] * n + ["b"] * n), "alternating": lambda: run(["a", "b"] * n)}
        per = common.alternate(sides, args.rounds)
    finally:
        server.stop()
    print(f"\n### Switching between two loaded models ({2 * args.requests} requests of {args.tokens} tokens a round, "
          f"{args.rounds} rounds)\n")
    print(common.markdown_table(["requests", "s per request"], [[k, common.spread(v, "{:.3f}")] for k, v in per.items()]))
    print(f"\nalternating / each alone: {common.round_ratio(per['alternating'], per['each alone']):.3f} "
          "(median of the rounds' ratios)")


def load(args: argparse.Namespace) -> None:
    server = Server(args.model[:1], args.serve)
    cold, warm = [], []
    try:
        server.ask("a", 0, args.tokens)  # the quantised copy written and the files read once
        for r in range(args.rounds):
            server.unload("a")
            cold.append(server.ask("a", 2 * r + 1, args.tokens)[0])
            warm.append(server.ask("a", 2 * r + 2, args.tokens)[0])
    finally:
        server.stop()
    extra = [c - w for c, w in zip(cold, warm)]
    print(f"\n### Loading on the first request ({args.rounds} rounds)\n")
    print(common.markdown_table(["first token", "s"], [["just unloaded (load included)", common.spread(cold)],
                                                      ["loaded", common.spread(warm)],
                                                      ["load beyond the first token", common.spread(extra)]]))


def memory(args: argparse.Namespace) -> None:
    if len(args.model) < 3:
        raise SystemExit("memory needs three --model")
    server = Server(args.model[:3], ["--max-loaded", "2", *args.serve])
    rows, ratios, footprint = [], [], None
    try:
        for name in ("a", "b"):
            server.ask(name, 0, args.tokens)
        time.sleep(SETTLE_S)
        footprint = before = server.rss()
        cycle = ["c", "a", "b"]
        for r in range(args.rounds):
            wanted = cycle[r % 3]
            server.ask(wanted, r + 1, args.tokens)
            time.sleep(SETTLE_S)
            after = server.rss()
            ratios.append(after / before)
            rows.append([r + 1, wanted, ", ".join(server.loaded()), f"{before / 2**20:.0f}", f"{after / 2**20:.0f}",
                         f"{server.held() / 2**20:.0f}", f"{after / before:.3f}", f"{after / footprint:.3f}"])
            before = after
    finally:
        server.stop()
    print(f"\n### Memory with --max-loaded 2 and a third model requested ({args.rounds} rounds)\n")
    print(f"two models' footprint (RSS with a and b loaded, idle): {footprint / 2**20:.0f} MB\n")
    print(common.markdown_table(["round", "requested", "loaded after", "RSS before MB", "RSS after MB",
                                 "held by the loaded (/api/ps) MB", "after / before", "after / two models' footprint"],
                                rows))
    print(f"\nafter / before: {common.spread(ratios, '{:.3f}')}")


PARTS = {"switching": switching, "load": load, "memory": memory}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="a checkpoint (give three, all parts)")
    p.add_argument("--parts", default="switching,load,memory")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=4, help="switching: requests to each model a round")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("serve", nargs=argparse.REMAINDER, help="after --: flags for qvl serve (e.g. --threads 2)")
    args = p.parse_args()
    args.serve = [a for a in args.serve if a != "--"]
    common.stop_on_sigterm()
    print(f"CPU: {common.cpu_class()}; models: {', '.join(f'{n}={m}' for n, m in zip(NAMES, args.model))}")
    for part in args.parts.split(","):
        PARTS[part](args)


if __name__ == "__main__":
    main()
