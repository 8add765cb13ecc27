"""`qvl serve --ray` on a local Ray cluster: how content routing keeps a photo's follow-ups on the
replica that has its image cached, and what a second replica adds, in one run.

1. Affinity: U users, each with their own photo, ask a first question about it (all at
   once), then their Q-1 follow-ups arrive in a shuffled order, W at a time, against 2
   replicas routed by content (qvl's router), round robin, and Ray Serve's default (power
   of two choices on queue lengths). A follow-up hits when the replica that
   answers it is the one that answered the photo's first question (the header
   x-qvl-replica says which). Also the follow-ups' median latency: the payoff of a hit.
2. Throughput: 1 replica against 2, each replica 1 CPU (1 thread) with C clients per
   replica sending distinct text prompts with fixed-length answers; aggregate completion
   tokens per second. The sides alternate, R rounds; medians and spreads.
3. (--ceiling) The same without Ray or HTTP: 1 engine process against 2, C rows each, to
   show what the machine itself allows (its cores share one memory bus).

    python benchmarks/cluster.py --model /work/ckpt/qvl-2b
    python benchmarks/cluster.py --model /work/ckpt/qvl-2b --routers --ceiling   # throughput only

Needs the ray extra (`pip install -e .[ray]`).
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import subprocess
import sys
import threading
import time

import httpx
import ray
from PIL import Image
from ray import serve

import common
from qvl.engine import EngineOptions
from qvl.server.cluster import APP, REPLICA_HEADER, Scale, build
from qvl.server.settings import ServerSettings


def photo(seed: int, size: int) -> bytes:
    """A noisy photo-sized picture (random pixels: nothing cacheable but by its bytes)."""
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), bytes(rng.getrandbits(8) for _ in range(size * size * 3)))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    return buf.getvalue()


def deploy(model: str, scale: Scale, port: int) -> str:
    options = EngineOptions(model=model, threads=scale.cpus)
    serve.run(build(ServerSettings(queue_size=64, warm_up=True), options, scale), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    while httpx.get(f"{url}/health", timeout=10).json().get("replicas") != scale.replicas:
        time.sleep(0.5)
    for _ in range(4):  # the front's handle learns the replica set from Ray's controller (a new
        httpx.get(f"{url}/v1/models", timeout=60)  # router may route its very first requests on a partial set)
    time.sleep(2)
    return url


def ask(url: str, body: dict) -> tuple[str, float, int]:
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.headers[REPLICA_HEADER], time.perf_counter() - started, r.json()["usage"]["completion_tokens"]


def affinity(url: str, users: int, questions: int, image_px: int, tokens: int, workers: int):
    """Each user's first question about their photo (all users at once), then every follow-up
    of every user in a shuffled order, `workers` at a time: a follow-up arrives whenever,
    not right after its own previous answer. Returns (share of follow-ups answered by the
    replica that answered the photo's first question, mean follow-up seconds, the seconds of
    those hits, of the misses)."""
    uris = [common.data_uri(photo(u, image_px), "image/jpeg") for u in range(users)]

    def body(u: int, q: int) -> dict:
        return {"model": "m", "max_tokens": tokens, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uris[u]}}, {"type": "text", "text": f"Question {q}: what?"}]}]}

    first: dict[int, str] = {}

    def run(jobs: list[tuple[int, int]], threads: int) -> list[tuple[int, str, float]]:
        out, lock = [], threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not jobs:
                        return
                    u, q = jobs.pop()
                replica, seconds, _ = ask(url, body(u, q))
                with lock:
                    out.append((u, replica, seconds))

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return out

    for u, replica, _ in run([(u, 0) for u in range(users)], users):
        first[u] = replica
    follow_ups = [(u, q) for u in range(users) for q in range(1, questions)]
    random.Random(0).shuffle(follow_ups)
    answers = run(follow_ups, workers)
    hits = [seconds for u, replica, seconds in answers if replica == first[u]]
    misses = [seconds for u, replica, seconds in answers if replica != first[u]]
    return len(hits) / len(answers), statistics.mean(hits + misses), hits, misses


def cpu_seconds() -> dict[str, tuple[float, str]]:
    """CPU seconds so far of every process on the machine, by pid (with its command)."""
    out = subprocess.run(["ps", "-eo", "pid,cputimes,args", "--no-headers"], capture_output=True, text=True).stdout
    seconds = {}
    for line in out.splitlines():
        pid, cpu, *command = line.split(None, 2)
        seconds[pid] = (float(cpu), command[0] if command else "")
    return seconds


def cpu_shares(before: dict, after: dict, wall: float) -> tuple[list[float], float]:
    """(each replica's share of a core, everything else's) between two cpu_seconds()."""
    replicas, rest = [], 0.0
    for pid, (cpu, command) in after.items():
        used = (cpu - before[pid][0]) / wall if pid in before else 0.0
        if "ServeReplica:qvl:Replica" in command:
            replicas.append(used)
        else:
            rest += used
    return sorted(replicas, reverse=True), rest


def throughput(url: str, clients: int, requests_each: int, tokens: int, tag: int) -> float:
    """Completion tokens per second over the whole run of `clients` concurrent clients."""
    total = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests_each):
            body = {"model": "m", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Run {tag}, client {c}, request {i}: tell a story."}]}
            _, _, n = ask(url, body)
            with lock:
                total[0] += n

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0] / (time.perf_counter() - started)


CEILING = r'''
import sys, time
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
engine = Engine.load(EngineOptions(model=sys.argv[1], threads=1, prefix_cache_mb=0, answer_cache_entries=0))
engine.warm_up()
requests = [Request([{"role": "user", "content": f"client {i}: tell a story."}],
                    SamplingParams(temperature=0, max_new_tokens=int(sys.argv[3]), ignore_eos=True))
            for i in range(int(sys.argv[2]))]
print("ready", flush=True)
sys.stdin.readline()  # start together
started = time.perf_counter()
done = engine.generate_batch(requests)
print(sum(d.usage.completion_tokens for d in done) / (time.perf_counter() - started), flush=True)
'''


def ceiling(model: str, processes: int, rows: int, tokens: int) -> float:
    """Without Ray or HTTP: `processes` engines of 1 thread each decode `rows` requests
    together, started at the same moment; their summed tokens per second."""
    procs = [subprocess.Popen([sys.executable, "-c", CEILING, model, str(rows), str(tokens)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(processes)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return sum(float(proc.communicate()[0]) for proc in procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/work/ckpt/qvl-2b")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--image-px", type=int, default=448)
    p.add_argument("--workers", type=int, default=2, help="follow-ups in flight at once")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--clients-per-replica", type=int, default=4)
    p.add_argument("--requests-each", type=int, default=3)
    p.add_argument("--throughput-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ceiling", action="store_true",
                   help="also 1 engine against 2 without Ray or HTTP: what the machine allows")
    p.add_argument("--routers", nargs="*", default=["content", "round-robin", "pow-2"],
                   help="routers compared for affinity (none: skip that part)")
    args = p.parse_args()
    port = common.free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for router in args.routers:
            url = deploy(args.model, Scale(replicas=2, cpus=1, router=router), port)
            share, mean, hits, misses = affinity(url, args.users, args.questions, args.image_px,
                                                 args.answer_tokens, args.workers)

            def median(values: list[float]) -> str:
                return f"{statistics.median(values):.2f} s" if values else "-"

            print(f"affinity, router {router}: follow-ups on the photo's replica {share:.1%}; follow-up seconds: "
                  f"mean {mean:.2f}, median of hits {median(hits)}, of misses {median(misses)}", flush=True)
            serve.delete(APP)
        if not args.rounds:
            return
        rates: dict[int, list[float]] = {1: [], 2: []}
        for rnd in range(args.rounds):
            for replicas in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                url = deploy(args.model, Scale(replicas=replicas, cpus=1), port)
                before, started = cpu_seconds(), time.perf_counter()
                rate = throughput(url, args.clients_per_replica * replicas, args.requests_each,
                                  args.throughput_tokens, tag=rnd)
                shares, rest = cpu_shares(before, cpu_seconds(), time.perf_counter() - started)
                rates[replicas].append(rate)
                print(f"round {rnd + 1}, {replicas} replica(s), {args.clients_per_replica * replicas} clients: "
                      f"{rate:.1f} tokens/s; CPU, in cores: replicas {', '.join(f'{c:.2f}' for c in shares)}, "
                      f"everything else {rest:.2f}", flush=True)
                serve.delete(APP)
        for replicas, values in rates.items():
            print(f"{replicas} replica(s): {common.spread(values, '{:.1f}')} tokens/s")
        ratios = [b / a for a, b in zip(rates[1], rates[2])]
        print(f"2 replicas / 1 replica, per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
        if args.ceiling:
            bare = {1: [], 2: []}
            for rnd in range(args.rounds):
                for n in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                    bare[n].append(ceiling(args.model, n, args.clients_per_replica, args.throughput_tokens))
            ratios = [b / a for a, b in zip(bare[1], bare[2])]
            print(f"without Ray or HTTP, 2 engines / 1 engine ({args.clients_per_replica} rows each): "
                  f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x "
                  f"(1 engine {statistics.median(bare[1]):.1f} tokens/s)")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
