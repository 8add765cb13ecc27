"""A time limit and a cancel flag for work that runs in a thread. A thread cannot be stopped
from outside, so the work calls `check` between its steps (frames, images, parts) and stops
there with an exception naming what it was doing."""

from __future__ import annotations

import math
import threading
import time


class Cancelled(Exception):
    """Raised between steps once the work was cancelled (client gone, time limit, shutdown)."""


class DeadlineExceeded(Exception):
    """The work ran past its time limit; the message names the step that took too long."""


class Deadline:
    """`seconds` from now (None: no limit), or until `cancel()` from any thread."""

    def __init__(self, seconds: float | None = None):
        self.seconds = seconds
        self.ends = math.inf if seconds is None else time.monotonic() + seconds
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def left(self) -> float:
        """Seconds until the limit (inf without one)."""
        return max(0.0, self.ends - time.monotonic())

    def check(self, doing: str) -> None:
        """Raises Cancelled or DeadlineExceeded (naming `doing`, e.g. "decoding the video")."""
        if self._cancelled.is_set():
            raise Cancelled(f"{doing} was cancelled")
        if time.monotonic() > self.ends:
            raise DeadlineExceeded(f"{doing} took longer than the {self.seconds:g} s this server allows for "
                                   "preparing a request")
