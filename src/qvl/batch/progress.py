"""Progress while a batch runs (tqdm on a terminal, plain periodic lines otherwise) and the
summary at the end, which also decides the exit status."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class Summary:
    done: int = 0  # answered in this run
    failed: int = 0  # error rows written in this run
    skipped: int = 0  # already in the output file
    skipped_failed: int = 0  # of those, error rows from an earlier run (kept unless --retry-errors)
    interrupted: bool = False
    started: float = field(default_factory=time.perf_counter)

    def count(self, row: dict) -> None:
        if "error" in row:
            self.failed += 1
        else:
            self.done += 1

    @property
    def rate(self) -> float:
        """Items per minute in this run."""
        minutes = (time.perf_counter() - self.started) / 60
        return (self.done + self.failed) / minutes if minutes > 0 else 0.0

    def line(self) -> str:
        text = (f"{'interrupted' if self.interrupted else 'finished'}: done {self.done}, "
                f"failed {self.failed}, skipped {self.skipped}, {self.rate:.1f} items/min")
        if self.skipped_failed:
            text += f"; {self.skipped_failed} skipped item(s) failed in an earlier run (--retry-errors runs them again)"
        return text

    def exit_code(self) -> int:
        """130 after Ctrl-C, 1 when any item has an error row, else 0."""
        if self.interrupted:
            return 130
        return 1 if self.failed or self.skipped_failed else 0


class Progress:
    """Counts finished items; draws a tqdm bar on a terminal, else prints a line every `interval` s
    (starting with `name`)."""

    def __init__(self, total: int, interval: float = 10.0, stream=None, name: str = "qvl batch"):
        self.stream, self.name = stream or sys.stderr, name
        self.total, self.interval, self.count, self.failed = total, interval, 0, 0
        self.started = self.last = time.perf_counter()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = tqdm(total=total, unit="item", file=self.stream, dynamic_ncols=True) if tty else None

    def update(self, ok: bool) -> None:
        self.count += 1
        self.failed += not ok
        if self.bar is not None:
            self.bar.update(1)
            if not ok:
                self.bar.set_postfix(failed=self.failed, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= self.interval or self.count == self.total:
            self.last = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        elapsed = now - self.started
        rate = self.count / elapsed if elapsed > 0 else 0.0
        eta = tqdm.format_interval((self.total - self.count) / rate) if rate else "?"
        return (f"{self.name}: {self.count}/{self.total} items ({self.failed} failed), "
                f"{rate * 60:.1f} items/min, ETA {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
