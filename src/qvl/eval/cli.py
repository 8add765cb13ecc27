"""`qvl eval DATA --model M`: registers the subcommand, runs the configurations, prints the table."""

from __future__ import annotations

import argparse
import json

from qvl.batch.cli import DEFAULT_BATCH_SIZE
from qvl.options import SamplingOptions, add_engine_args, engine_options

DESCRIPTION = """\
Accuracy and speed of a model on a labelled set: a JSONL file (or a folder with labels.jsonl)
of {"id", "image" or "video", "page"?, "question", "answer", "kind"?} rows, kind text (the
default), boxes or points. Greedy answers through the batch path; per configuration: exact
match, character error rate (text), box IoU (boxes), point hits (points), speed. Comma lists
run side by side: --weights int8,int4,bf16 --int8-activations off,all --isa avx2,portable
(each tier in a process of its own). `python -m qvl.demo data` draws labelled sets."""


def register(sub, commands) -> None:
    p = sub.add_parser("eval", help="accuracy and speed on a labelled set, several configurations side by side",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       conflict_handler="resolve")
    p.add_argument("data", help="labels JSONL file, or a folder holding labels.jsonl")
    p.add_argument("--json", metavar="OUT", help="write every configuration's summary, speed and answers here")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"items in flight, as qvl batch (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--max-new-tokens", type=int, help="answer length limit (default: the checkpoint's)")
    add_engine_args(p)
    g = p.add_argument_group("configurations (comma-separated lists: every combination runs)")
    g.add_argument("--weights", default="auto", help="weight formats, e.g. int8,int4,bf16,fp32 (default auto)")
    g.add_argument("--int8-activations", default="auto", help="e.g. off,all (default auto)")
    g.add_argument("--isa", help="CPU tiers (QVL_ISA), e.g. avx2,portable; each runs in its own process "
                                 "(default: this machine's, in this process)")
    commands["eval"] = cmd_eval


def cmd_eval(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from qvl.eval.labels import read_labels
    from qvl.eval.run import Job, configurations, run
    from qvl.options import UsageError

    if args.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    labels = read_labels(args.data)
    base = engine_options(args)
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=args.max_new_tokens)
    results = []
    for config in configurations(args.weights, args.int8_activations, args.isa):
        options = replace(base, weights=config.weights, int8_activations=config.int8_activations)
        results.append(run(Job(labels, options, sampling, args.batch_size, config)))
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"data": args.data, "items": len(labels), "configurations": results}, f, ensure_ascii=False,
                      indent=1)
    return 0


def table(results: list[dict]) -> str:
    """A markdown table: one row per configuration; the kinds' columns where the set has them."""
    kinds = [k for k in ("text", "boxes", "points") if k in results[0]["summary"]]
    metric = {"text": ("CER", "cer"), "boxes": ("box IoU", "iou"), "points": ("point hits", "point_hits")}
    head = ["configuration", "exact"] + [f"{k} exact" for k in kinds] + [metric[k][0] for k in kinds] + \
        ["failed", "items/s", "tokens/s", "answer s"]
    rows = []
    for r in results:
        s, speed = r["summary"], r["speed"]
        rows.append([r["configuration"]["name"], f"{100 * s['exact']:.1f}%"]
                    + [f"{100 * s[k]['exact']:.1f}%" for k in kinds]
                    + [f"{s[k][metric[k][1]]:.3f}" for k in kinds]
                    + [str(s["failed"]), f"{speed['items_per_s']:.2f}", f"{speed['answer_tokens_per_s']:.1f}",
                       f"{speed['answer_s']:.1f}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + f"\n({results[0]['summary']['items']} items)"
