"""`qvl pull`, `qvl list`, `qvl rm`: models by name in the Hugging Face cache."""

from __future__ import annotations

import argparse
import json
import sys
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def ago(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    seconds = max(0.0, time.time() - stamp)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


class Bars:
    """One progress bar per file on a terminal (tqdm); nothing elsewhere."""

    def __init__(self):
        self.file, self.bar = None, None

    def __call__(self, p) -> None:
        from tqdm import tqdm

        if p.status not in ("pulling", "verifying"):
            self.close()
            return
        if p.file != self.file:
            self.close()
            self.file = p.file
            self.bar = tqdm(total=p.total, initial=p.completed or 0, desc=p.file, unit="B", unit_scale=True,
                            disable=None, leave=True, file=sys.stderr)
        elif self.bar is not None:
            self.bar.update((p.completed or 0) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file, self.bar = None, None


def cmd_pull(args: argparse.Namespace) -> int:
    from qvl.pull import pull

    bars = Bars()
    try:
        path = pull(args.name, bars, args.revision)
    finally:
        bars.close()
    print(f"pulled {args.name} into {path}")
    if args.weights:
        from qvl.engine import Engine, EngineOptions

        engine = Engine.load(EngineOptions(model=str(path), weights=args.weights))
        print(f"{engine.weights} weights kept for the next start")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from qvl.models import local_models

    found = local_models()
    if args.json:
        print(json.dumps([m.to_dict() for m in found]))
        return 0
    rows = [("NAME", "SIZE", "FORMATS", "LAST USED")] + [
        (m.name + (f" ({m.short})" if m.short else ""), human_bytes(m.size), ",".join(m.formats), ago(m.last_used))
        for m in found]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from qvl.models import remove

    status = 0
    for name in args.names:
        try:
            print(f"removed {name} ({human_bytes(remove(name))} freed)")
        except (LookupError, ValueError) as exc:
            print(f"qvl rm: error: {exc}", file=sys.stderr)
            status = 1
    return status


def register(sub, commands: dict) -> None:
    p = sub.add_parser("pull", help="download a model into the Hugging Face cache (resumable, checksums verified)")
    p.add_argument("name", help="a hub id (Qwen/Qwen3-VL-2B-Instruct) or a short name (qwen3-vl:2b, qwen3.5:9b, ...)")
    p.add_argument("--weights", choices=["int8", "int4"],
                   help="also make the quantised copy a start would make (int8 is the default format)")
    p.add_argument("--revision", default="main", help="a branch, tag or commit (default main)")
    commands["pull"] = cmd_pull

    p = sub.add_parser("list", help="the models in the Hugging Face cache: size, formats kept, last used")
    p.add_argument("--json", action="store_true")
    commands["list"] = cmd_list

    p = sub.add_parser("rm", help="delete models from the Hugging Face cache and their quantised copies")
    p.add_argument("names", nargs="+", metavar="name")
    commands["rm"] = cmd_rm
