"""The batch loop: open (repair, scan) the results file, skip the items already there, write
each new row as it comes, show progress, print the summary, return the exit status.
Where the rows come from is a `Backend`: this process's engine, or a Ray actor pool."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qvl.batch.inputs import Item
from qvl.batch.output import ResultsFile
from qvl.batch.process import WorkSpec, Worker
from qvl.batch.progress import Progress, Summary

Backend = Callable[[WorkSpec, list[Item]], Iterator[dict]]


@dataclass
class BatchJob:
    items: list[Item]
    out: Path
    spec: WorkSpec
    retry_errors: bool = False
    progress_interval: float = 10.0  # seconds between plain progress lines (not a terminal)


def local_rows(spec: WorkSpec, items: list[Item]) -> Iterator[dict]:
    """Rows from an engine in this process (loaded on the first row asked for)."""
    yield from Worker.from_spec(spec).rows(items)


def log(message: str) -> None:
    print(f"qvl batch: {message}", file=sys.stderr, flush=True)


def open_results(job: BatchJob) -> ResultsFile:
    results = ResultsFile(job.out)
    if results.repaired_bytes:
        log(f"{job.out}: removed a truncated last line ({results.repaired_bytes} bytes) left by an interrupted run")
    if results.scan.bad_lines:
        log(f"{job.out}: ignoring {results.scan.bad_lines} line(s) that are not result rows")
    if job.retry_errors and (dropped := results.drop_errors()):
        log(f"{job.out}: removed {dropped} error row(s) to run those items again")
    return results


def run(job: BatchJob, backend: Backend = local_rows) -> int:
    """Run the items not yet in the output; returns the exit status (0, 1 or 130)."""
    with open_results(job) as results:
        todo = [item for item in job.items if item.id not in results.done]
        summary = Summary(skipped=len(job.items) - len(todo))
        summary.skipped_failed = sum(1 for item in job.items if results.done.get(item.id) is False)
        if summary.skipped:
            log(f"resuming: {summary.skipped} of {len(job.items)} item(s) already in {job.out}")
        if todo:
            write_rows(backend(job.spec, todo), results, summary, Progress(len(todo), job.progress_interval))
    log(summary.line())
    return summary.exit_code()


def write_rows(rows: Iterator[dict], results: ResultsFile, summary: Summary, progress: Progress) -> None:
    """Each row to disk as soon as it comes; Ctrl-C stops between rows, never inside one."""
    try:
        for row in rows:
            results.write(row)
            summary.count(row)
            progress.update("error" not in row)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        progress.close()
