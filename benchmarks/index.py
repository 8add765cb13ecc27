"""`qvl index`: search latency over many stored vectors, and `add` throughput on PDF pages.

    python benchmarks/index.py search --vectors 100000 --dims 2048 --queries 200
    python benchmarks/index.py add --model /work/ckpt/qvl-embedding-2b --pages 200

search: --vectors random unit vectors of --dims dimensions go into a new store through its
own path (one committed entry each, as `qvl index add` writes them), then its HNSW graph is
built from the database, saved, and loaded again by a fresh Store (what a new process does).
Each query is a whole `Store.search` (graph, exact rescoring from the database, the files'
paths) for k = 10; the latency's median, 90th percentile and min-max are printed, and the
recall@10 against an exact search (every vector's inner product) for two kinds of query: a
stored vector plus noise (a near-duplicate: it should come first), and a random vector (the
hard case for a graph: in random data the ten nearest are barely nearer than the rest).

add: a folder holding one PDF of --pages scanned A4 pages (benchmarks/pdf.py's), indexed
with `qvl.retrieval.index.add` by an engine loaded once; pages per minute, then a second add
of the same folder (nothing to embed: the time to hash and check).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import common
from qvl.retrieval.store import FileRow, Store

K = 10


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def filled_store(folder: Path, vectors: np.ndarray) -> float:
    """A store holding `vectors`, one file per entry; returns the seconds the entries took."""
    store = Store.open(folder, {"model": "random", "dimensions": str(vectors.shape[1]), "instruction": "",
                                "query_instruction": ""})
    started = time.perf_counter()
    for i, vector in enumerate(vectors):
        store.add([FileRow(f"/random/{i:07}.png", f"{i:064x}", "image", 0, 0, None)], 0, vector)
    took = time.perf_counter() - started
    store.close()
    return took


def recall(found: list[list[int]], exact: list[list[int]]) -> float:
    return statistics.mean(len(set(f) & set(e)) / K for f, e in zip(found, exact))


def bench_search(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    vectors = unit(rng.standard_normal((args.vectors, args.dims), dtype=np.float32))
    planted = rng.integers(0, args.vectors, args.queries)
    noise = rng.standard_normal((args.queries, args.dims), dtype=np.float32) * (0.7 / np.sqrt(args.dims))
    queries = {"near-duplicate": unit(vectors[planted] + noise),
               "random": unit(rng.standard_normal((args.queries, args.dims), dtype=np.float32))}
    with tempfile.TemporaryDirectory(prefix="qvl-index-bench-") as tmp:
        folder = Path(tmp) / "idx"
        entries_s = filled_store(folder, vectors)
        store = Store.open(folder)
        started = time.perf_counter()
        store.graph()
        build_s = time.perf_counter() - started
        started = time.perf_counter()
        store.save_graph()
        save_s = time.perf_counter() - started
        store.close()
        started = time.perf_counter()
        store = Store.open(folder)
        store.graph()
        load_s = time.perf_counter() - started
        database = sum(p.stat().st_size for p in folder.glob("entries.sqlite*"))  # with its WAL
        graph = sum(p.stat().st_size for p in folder.glob("vectors-*.faiss"))
        print(f"## {args.vectors:,} vectors of {args.dims} dimensions\n")
        print(f"entries committed one by one: {entries_s:.1f} s ({args.vectors / entries_s:,.0f}/s); graph built "
              f"from the database {build_s:.1f} s, saved {save_s:.1f} s, loaded by a new Store {load_s:.1f} s")
        print(f"on disk: the database {database / 2**20:.0f} MB, the graph {graph / 2**20:.0f} MB\n")
        table = []
        for kind, rows in queries.items():
            times, found = [], []
            for q in rows:
                started = time.perf_counter()
                hits = store.search(q, K)
                times.append((time.perf_counter() - started) * 1000)
                found.append([int(h.path[8:15]) for h in hits])  # /random/0001234.png -> 1234
            exact = [np.argsort(-(vectors @ q))[:K].tolist() for q in rows]
            first = f"{sum(f[0] == p for f, p in zip(found, planted))}/{len(rows)}" if kind == "near-duplicate" else ""
            table.append([kind, f"{statistics.median(times):.2f}", f"{np.percentile(times, 90):.2f}",
                          f"{min(times):.2f}-{max(times):.2f}", f"{recall(found, exact):.3f}", first])
        print(common.markdown_table(["queries", "median ms", "p90 ms", "min-max ms", "recall@10",
                                     "first is the planted one"], table))


def bench_add(args: argparse.Namespace) -> None:
    from pdf import scanned_pdf  # benchmarks/pdf.py

    from qvl.engine import Engine, EngineOptions
    from qvl.retrieval.index import add

    engine = Engine.load(EngineOptions(model=args.model, threads=args.threads))
    with tempfile.TemporaryDirectory(prefix="qvl-index-bench-") as tmp:
        docs = Path(tmp) / "docs"
        docs.mkdir()
        (docs / "scans.pdf").write_bytes(scanned_pdf(args.pages))
        store = Store.open(Path(tmp) / "idx", {"model": args.model, "dimensions": str(engine.cfg.text.hidden_size),
                                               "instruction": "", "query_instruction": ""})
        rounds = []
        for _ in range(2):
            started = time.perf_counter()
            summary = add(engine, store, [docs], progress_interval=60)
            rounds.append((time.perf_counter() - started, summary))
    (first_s, first), (again_s, again) = rounds
    print(f"## qvl index add, {args.pages} scanned A4 pages, {engine.model_name} ({engine.weights})\n")
    print(f"first add: {first.added} pages in {first_s:.1f} s = {first.added / first_s * 60:.1f} pages/min "
          f"({first_s / max(first.added, 1) * 1000:.0f} ms/page)")
    print(f"second add: {again.added} embedded, {again.present} already there, {again_s:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    s = sub.add_parser("search", help="search latency and recall over stored random vectors")
    s.add_argument("--vectors", type=int, default=100_000)
    s.add_argument("--dims", type=int, default=2048)
    s.add_argument("--queries", type=int, default=200, help="of each kind")
    s.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("add", help="qvl index add throughput on scanned PDF pages")
    a.add_argument("--model", required=True, help="an embedding checkpoint (qvl synth --preset embedding-2b)")
    a.add_argument("--pages", type=int, default=200)
    a.add_argument("--threads", type=int)
    args = p.parse_args()
    print(f"CPU: {common.cpu_class()}\n")
    bench_search(args) if args.part == "search" else bench_add(args)


if __name__ == "__main__":
    main()
