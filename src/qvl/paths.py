"""Where qvl keeps what it builds (native kernels, quantised weights), and a portable file lock.

The cache root is $QVL_CACHE_DIR, else $XDG_CACHE_HOME/qvl, else ~/.cache/qvl. When that
folder cannot be written (a read-only or missing home, a locked-down container), qvl uses a
per-user folder under the system's temporary directory instead and says so once."""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path


def _preferred_root() -> Path:
    if env := os.environ.get("QVL_CACHE_DIR"):
        return Path(env)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "qvl"
    return Path.home() / ".cache" / "qvl"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            return True
    except (OSError, RuntimeError):  # RuntimeError: Path.home() without a home
        return False


@lru_cache(maxsize=1)
def cache_root() -> Path:
    """The folder for qvl's caches: the preferred one where it can be written, else a
    temporary per-user folder (one warning on stderr)."""
    try:
        preferred = _preferred_root()
    except RuntimeError:  # no home directory at all
        preferred = None
    if preferred is not None and _writable(preferred):
        return preferred
    user = os.environ.get("USER") or os.environ.get("USERNAME") or str(getattr(os, "getuid", lambda: "user")())
    fallback = Path(tempfile.gettempdir()) / f"qvl-cache-{user}"
    print(f"qvl: cannot write the cache folder {preferred}; using {fallback} (set QVL_CACHE_DIR to choose one)",
          file=sys.stderr)
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


@contextmanager
def locked(path: Path):
    """Hold an exclusive lock on `path` (created if needed) for the block: a second process
    waits. fcntl on POSIX, msvcrt on Windows."""
    with open(path, "a+b") as f:
        if sys.platform == "win32":
            import msvcrt

            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
