"""`qvl embed` and `qvl rerank`: embeddings and relevance scores on the command line (a front
door the `qvl` subcommand table registers)."""

from __future__ import annotations

import argparse
import json
import sys

from qvl.options import add_engine_args, engine_options


def register(sub: argparse._SubParsersAction, commands: dict) -> None:
    p = sub.add_parser("embed", help="embeddings of texts, images, PDF pages and videos (an embedding model: "
                                     "Qwen3-VL-Embedding); one JSON line per input")
    p.add_argument("text", nargs="*", help="texts, each an input of its own; - reads one input per line from stdin")
    p.add_argument("-i", "--image", action="append", default=[],
                   help="image file, each an input of its own; a PDF gives one input per page (doc.pdf#pages=2-4: "
                        "those pages) (repeatable)")
    p.add_argument("-v", "--video", action="append", default=[], help="video file, an input of its own (repeatable)")
    p.add_argument("--together", action="store_true",
                   help="all texts, images and videos given make one input (one embedding of them all)")
    p.add_argument("--instruction", help="what the embedding is for (default: \"Represent the user's input.\")")
    p.add_argument("--dimensions", type=int, help="keep the first N dimensions, re-normalised (Matryoshka)")
    add_engine_args(p)
    commands["embed"] = cmd_embed

    p = sub.add_parser("rerank", help="score documents (texts, images, PDF pages) against a query with a reranker "
                                      "(Qwen3-VL-Reranker); best first")
    p.add_argument("query", help="the query text; - reads it from stdin")
    p.add_argument("documents", nargs="*", help="document texts")
    p.add_argument("-i", "--image", action="append", default=[],
                   help="document image, or a PDF (one document per page) (repeatable)")
    p.add_argument("--query-image", action="append", default=[], help="an image that is part of the query (repeatable)")
    p.add_argument("--instruction",
                   help="what relevance means (default: \"Given a search query, retrieve relevant candidates that "
                        "answer the query.\")")
    p.add_argument("-k", "--top", type=int, help="show the best K only")
    p.add_argument("--json", action="store_true", help="one JSON object: results with index, document, relevance_score")
    add_engine_args(p)
    commands["rerank"] = cmd_rerank


def image_inputs(paths: list[str]) -> list[tuple[str, list[dict]]]:
    """(label, parts) per image file, and per page of a PDF."""
    from qvl.cli import check_files, question_images

    check_files(paths)
    return [(single[0], [{"type": "image", "image": single[0]}]) for single in question_images(paths, True) if single]


def embed_inputs(args: argparse.Namespace) -> list[tuple[str, list[dict]]]:
    """(label, content parts) of each input the arguments give."""
    from qvl.cli import check_files

    texts = sys.stdin.read().splitlines() if args.text == ["-"] else args.text
    check_files(args.video, "video")
    inputs = [(text, [{"type": "text", "text": text}]) for text in texts] + image_inputs(args.image) + \
        [(path, [{"type": "video", "video": path}]) for path in args.video]
    if not inputs:
        raise ValueError("give texts, images (-i) or videos (-v) to embed")
    if args.together:
        return [(" + ".join(label for label, _ in inputs), [part for _, parts in inputs for part in parts])]
    return inputs


def cmd_embed(args: argparse.Namespace) -> int:
    from qvl.engine import Engine
    from qvl.retrieval.encode import embed

    inputs = embed_inputs(args)
    engine = Engine.load(engine_options(args))
    vectors, _ = embed(engine, [parts for _, parts in inputs], args.instruction, args.dimensions)
    for i, ((label, _), vector) in enumerate(zip(inputs, vectors)):
        print(json.dumps({"index": i, "input": label, "embedding": vector.tolist()}, ensure_ascii=False))
    return 0


def cmd_rerank(args: argparse.Namespace) -> int:
    from qvl.cli import check_files
    from qvl.engine import Engine
    from qvl.retrieval.encode import rerank

    query_text = sys.stdin.read().strip() if args.query == "-" else args.query
    check_files(args.query_image)
    query = [{"type": "image", "image": path} for path in args.query_image] + [{"type": "text", "text": query_text}]
    documents = [(text, [{"type": "text", "text": text}]) for text in args.documents] + image_inputs(args.image)
    if not documents:
        raise ValueError("give documents to score: texts, or images and PDFs with -i")
    if args.top is not None and args.top < 1:
        raise ValueError("--top must be >= 1")
    engine = Engine.load(engine_options(args))
    scores, _ = rerank(engine, query, [parts for _, parts in documents], args.instruction)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: args.top]
    results = [{"index": i, "document": documents[i][0], "relevance_score": scores[i]} for i in ranked]
    if args.json:
        print(json.dumps({"results": results}, ensure_ascii=False))
    else:
        for r in results:
            print(f"{r['relevance_score']:.4f}  {r['document']}")
    return 0
