"""The results file: append-only JSONL, one whole line per item.

Each row goes out in one `os.write` of the complete line on an O_APPEND descriptor,
then `fsync`, so a kill at any moment leaves at most a truncated last line. Opening the
file repairs such a line (truncates it away), then reads which ids are done. Good lines
are never rewritten; `drop_errors` (for --retry-errors) removes error rows by writing a
copy and renaming it over the original, so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from qvl.batch.inputs import UsageError

try:
    import fcntl
except ImportError:  # not POSIX: no lock against a second writer
    fcntl = None


@dataclass
class Scan:
    done: dict[str, bool] = field(default_factory=dict)  # id -> succeeded (False: an error row)
    bad_lines: int = 0  # complete lines that are not JSON objects with an id (kept, ignored)


def repair(path: Path) -> int:
    """Truncate a partial last line (no trailing newline); returns the bytes removed."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            chunk = f.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())
        return size - end


def scan(path: Path) -> Scan:
    result = Scan()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            row = _parse(line)
            if row is None:
                result.bad_lines += 1
            else:
                result.done[str(row["id"])] = "error" not in row
    return result


def _parse(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and "id" in row else None


class ResultsFile:
    """An open results file: repaired, scanned, locked against a second writer."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(f"cannot write the results file {self.path}: {exc.strerror or exc}") from None
        try:
            self._lock()
            self.repaired_bytes = repair(self.path)
            self.scan = scan(self.path)
        except BaseException as exc:
            os.close(self.fd)
            if isinstance(exc, OSError):
                raise UsageError(f"cannot read the results file {self.path}: {exc.strerror or exc}") from None
            raise

    def _lock(self) -> None:
        if fcntl is None:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another qvl batch is writing to {self.path}") from None

    @property
    def done(self) -> dict[str, bool]:
        return self.scan.done

    def write(self, row: dict) -> None:
        """Append one row as one whole line, then flush it to disk (fsync: ~4 ms, next to
        a second or more per item). The line is UTF-8 JSON: a file name's bytes that are not
        UTF-8 (held as surrogates U+DC80-U+DCFF) go out as JSON escapes (`\\udcff`),
        which read back to the same id (resume) and path (`os.fsencode` gives the bytes)."""
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", errors="backslashreplace")
        while data:  # a regular file takes it in one call; loop only for a short write
            data = data[os.write(self.fd, data) :]
        os.fsync(self.fd)
        self.scan.done[str(row["id"])] = "error" not in row

    def drop_errors(self) -> int:
        """Remove the error rows (to run those items again); returns how many went."""
        if all(self.done.values()):
            return 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        dropped = 0
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for line in src:
                row = _parse(line.decode("utf-8", errors="replace"))
                if row is not None and "error" in row:
                    dropped += 1
                else:
                    dst.write(line)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self.fd)  # the old descriptor points at the replaced file
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._lock()
        self.scan = scan(self.path)
        return dropped

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
