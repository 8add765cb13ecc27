"""`qvl batch INPUT --out results.jsonl`: registers the subcommand and builds the job."""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path

from qvl.options import SamplingOptions, UsageError, add_engine_args, add_sampling_args, engine_options, prompt_text

DEFAULT_BATCH_SIZE = 4  # items decoded together; see docs/batch.md for the measurement

DESCRIPTION = """\
Answer one prompt (or each JSONL row's own) over many images or videos, one JSON line per item in --out.
Re-running the same command skips the items already in --out and appends the rest; a row
with "error" counts as done unless --retry-errors. With --json-schema each row also carries
the parsed answer under "json"; an answer that reaches --max-new-tokens before its JSON is
complete gets an "error" saying so (its text is kept), so --retry-errors with a larger
--max-new-tokens runs it again. Exit status: 0 all answered, 1 some items failed, 2 usage
error, 130 interrupted."""


def register(sub, commands) -> None:
    p = sub.add_parser("batch", help="run a prompt over many images or videos into a resumable JSONL file",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help='a folder (recursive), a quoted glob such as "scans/**/*.png", '
                                 'or a JSONL file of {"id", "image" or "video", "prompt"} rows; videos by their extension '
                                 '(.mp4, .webm, .mkv, .mov, .avi, ...)')
    p.add_argument("--out", "-o", required=True, help="results file (JSONL), appended to")
    p.add_argument("--prompt", "-p", help="prompt for every image (a JSONL row's own prompt wins); - reads stdin")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"items decoded together (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--retry-errors", action="store_true", help="run items with an error row in --out again")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between progress lines when stderr is not a terminal (default 10)")
    g = p.add_argument_group("Ray (pip install 'qvl[ray]')")
    g.add_argument("--ray", action="store_true", help="run on a Ray cluster with Ray Data")
    g.add_argument("--ray-address", help="cluster address (default: $RAY_ADDRESS, else a local instance)")
    g.add_argument("--ray-actors", type=int, default=1, help="engines (actors), each of --threads CPUs (default 1)")
    add_engine_args(p)
    add_sampling_args(p)
    commands["batch"] = cmd_batch


def cmd_batch(args: argparse.Namespace) -> int:
    from qvl.batch.runner import run

    try:
        job, backend = build_job(args)
        return run(job, backend)  # an --out that cannot be opened is a UsageError too
    except UsageError as exc:
        print(f"qvl batch: error: {exc}", file=sys.stderr)
        return 2


def build_job(args: argparse.Namespace):
    """The job and its backend from the flags; UsageError for anything that cannot start."""
    from qvl.batch.inputs import read_items
    from qvl.batch.process import WorkSpec
    from qvl.batch.runner import BatchJob, local_rows

    if args.batch_size < 1 or args.ray_actors < 1:
        raise UsageError("--batch-size and --ray-actors must be at least 1")
    items = read_items(args.input)
    check_output(Path(args.out), args.input, items)
    prompt = prompt_text(args.prompt, args.task) if args.prompt or args.task else None
    missing = [item.id for item in items if item.prompt is None]
    if prompt is None and missing:
        raise UsageError(f"{len(missing)} item(s) have no prompt (first: {missing[0]!r}): give --prompt or --task")
    sampling = SamplingOptions.from_args(args)  # files read here, once: Ray actors get the constraint, not the path
    options = engine_options(args)
    backend = local_rows
    if args.ray:
        from qvl.batch.ray_runner import import_ray, ray_rows

        if args.cpus:
            raise UsageError("--cpus pins this machine's CPUs; with --ray give --threads (CPUs per actor)")
        import_ray()
        options = replace(options, threads=args.threads or 1)
        backend = functools.partial(ray_rows, address=args.ray_address, actors=args.ray_actors)
    spec = WorkSpec(options, sampling, prompt, args.batch_size)
    return BatchJob(items, Path(args.out), spec, args.retry_errors, args.progress_every), backend



def check_output(out: Path, source: str, items) -> None:
    """--out must not be the input file or one of the images: appending results to it would
    corrupt it, and a JSONL input's rows would be taken for finished results."""
    inputs = [Path(source)] + [Path(item.path) for item in items]
    if not out.exists():
        return
    for path in inputs:
        try:
            same = path.is_file() and out.samefile(path)
        except OSError:
            continue
        if same:
            what = "the input" if path == inputs[0] else f"the input image {path}"
            raise UsageError(f"--out {out} is {what}: write the results to another file")
