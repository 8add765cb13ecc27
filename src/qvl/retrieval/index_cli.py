"""`qvl index add | search | info | list`: a searchable index of a folder's images, PDF pages
and clips (a front door the `qvl` subcommand table registers)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from qvl.options import UsageError, add_engine_args, engine_options


def register(sub: argparse._SubParsersAction, commands: dict) -> None:
    p = sub.add_parser("index", help="an index of a folder's images, PDF pages and clips, searched by text or image "
                                     "(an embedding model: Qwen3-VL-Embedding)")
    actions = p.add_subparsers(dest="index_command", required=True)

    a = actions.add_parser("add", help="embed every image, PDF page and clip under the folders that the index "
                                       "lacks (resumable: run it again after an interruption)")
    a.add_argument("folders", nargs="+", type=Path, help="folders to index, recursively")
    a.add_argument("--db", required=True, type=Path, help="the index folder (made by the first add)")
    a.add_argument("--dimensions", type=int, help="a new index: keep the first N dimensions of each vector, "
                                                  "re-normalised (Matryoshka; default: all the model's)")
    a.add_argument("--instruction", help="a new index: the documents' instruction (default: \"Represent the user's "
                                         "input.\")")
    a.add_argument("--query-instruction", help="a new index: the queries' instruction (default: \"Retrieve images "
                                               "or text relevant to the user's query.\")")
    a.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between progress lines when stderr is not a terminal (default 10)")
    add_engine_args(a)

    s = actions.add_parser("search", help="the entries nearest to a text (and/or image) query, best first")
    s.add_argument("db", type=Path, help="the index folder")
    s.add_argument("query", nargs="?", default="", help="the query text; - reads it from stdin")
    s.add_argument("-i", "--image", action="append", default=[], help="an image that is part of the query (repeatable)")
    s.add_argument("-k", "--top", type=int, default=10, help="results to show (default 10)")
    s.add_argument("--rerank", action="store_true", help="score the best candidates with a reranker (--reranker) "
                                                         "and order them by it")
    s.add_argument("--reranker", help="the reranker model (Qwen3-VL-Reranker) for --rerank")
    s.add_argument("--candidates", type=int, help="with --rerank: how many of the nearest entries the reranker "
                                                  "scores (default: 3 x --top)")
    s.add_argument("--instruction", help="the query's instruction (default: the index's)")
    s.add_argument("--json", action="store_true", help="one JSON object: query, results with path, page, kind, "
                                                       "score (and rerank_score)")
    add_engine_args(s)

    for name, what in (("info", "the index's model, settings, counts and size"),
                       ("list", "the files indexed, with their kind and entries")):
        i = actions.add_parser(name, help=what)
        i.add_argument("db", type=Path, help="the index folder")
        i.add_argument("--json", action="store_true")
    commands["index"] = lambda args: {"add": cmd_add, "search": cmd_search, "info": cmd_info,
                                      "list": cmd_list}[args.index_command](args)


def model_key(name: str) -> str:
    """A model as the index records it: a local folder's absolute path, else the hub id."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def index_model(store, given: str | None) -> str:
    """The index's model; a different one given is an error (its vectors would not compare)."""
    model = store.meta["model"]
    if given is not None and model_key(given) != model:
        raise UsageError(f"the index {store.folder} holds vectors of {model}; --model {given} would make vectors "
                         f"that do not compare with them (leave --model out, or give a new --db)")
    return model


def cmd_add(args: argparse.Namespace) -> int:
    from qvl.engine import Engine
    from qvl.retrieval.index import QUERY_INSTRUCTION, add, require_embedding_model
    from qvl.retrieval.store import DATABASE, Store, faiss_module

    faiss_module()  # before anything is loaded or made
    for folder in args.folders:
        if not folder.is_dir():
            raise UsageError(f"not a folder: {folder}")
    existing = Store.open(args.db) if (args.db / DATABASE).is_file() else None
    if existing is None and args.model is None:
        raise UsageError(f"a new index needs --model (an embedding model: Qwen3-VL-Embedding) for {args.db}")
    if existing is not None and args.dimensions not in (None, existing.dims):
        raise UsageError(f"the index {args.db} keeps {existing.dims} dimensions; --dimensions {args.dimensions} "
                         "would not compare with them")
    if existing is not None and (args.instruction or args.query_instruction):
        raise UsageError("--instruction and --query-instruction are the index's own, set by its first add")
    model = index_model(existing, args.model) if existing else model_key(args.model)
    engine = Engine.load(replace(engine_options(args), model=model))
    require_embedding_model(engine)
    width = engine.cfg.text.hidden_size
    if args.dimensions is not None and not 1 <= args.dimensions <= width:
        raise UsageError(f"--dimensions must be between 1 and the model's {width}")
    store = existing or Store.open(args.db, {
        "model": model, "dimensions": str(args.dimensions or width), "instruction": args.instruction or "",
        "query_instruction": args.query_instruction or QUERY_INSTRUCTION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    summary = add(engine, store, args.folders, args.progress_every)
    print(f"qvl index add: {summary.line()}", file=sys.stderr)
    return summary.exit_code()


def cmd_search(args: argparse.Namespace) -> int:
    from qvl.cli import check_files
    from qvl.engine import Engine
    from qvl.retrieval.index import reranked, search
    from qvl.retrieval.store import Store, faiss_module

    text = sys.stdin.read().strip() if args.query == "-" else args.query
    check_files(args.image)
    if not text and not args.image:
        raise UsageError("give a query text, or a query image with -i")
    if args.top < 1 or (args.candidates is not None and args.candidates < 1):
        raise UsageError("-k and --candidates must be >= 1")
    if args.rerank != (args.reranker is not None):
        raise UsageError("--rerank needs --reranker MODEL, and --reranker goes with --rerank")
    faiss_module()
    store = Store.open(args.db)
    options = replace(engine_options(args), model=index_model(store, args.model))
    query = [{"type": "image", "image": path} for path in args.image] + \
        ([{"type": "text", "text": text}] if text else [])
    hits = search(Engine.load(options), store, query, max(args.top, args.candidates or 3 * args.top)
                  if args.rerank else args.top, args.instruction)
    results = [h.to_dict() for h in hits]
    if args.rerank:
        results = [{**h.to_dict(), "rerank_score": score}
                   for h, score in reranked(Engine.load(replace(options, model=args.reranker)), query, hits)]
    results = results[: args.top]
    if args.json:
        print(json.dumps({"query": text, "images": args.image, "results": results}, ensure_ascii=False))
    else:
        for r in results:
            rerank = f"{r['rerank_score']:.4f}  " if args.rerank else ""
            page = f"  (page {r['page']})" if r["page"] is not None else ""
            print(f"{rerank}{r['score']:.4f}  {r['path']}{page}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from qvl.retrieval.store import Store

    store = Store.open(args.db)
    sizes = {p.name: p.stat().st_size for p in args.db.iterdir() if p.is_file()}
    info = {"db": str(args.db), **{k: v for k, v in store.meta.items() if k != "store_id"}, **store.counts(),
            "bytes": sum(sizes.values())}
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
    else:
        for key, value in info.items():
            print(f"{key:18} {value}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from qvl.retrieval.store import Store

    for row, entries in Store.open(args.db).files():
        if args.json:
            print(json.dumps({"path": row.path, "kind": row.kind, "pages": row.pages, "entries": entries}))
        else:
            print(f"{row.kind:5} {entries:6}  {row.path}")
    return 0
