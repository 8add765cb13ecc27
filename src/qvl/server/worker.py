"""The one engine worker: a thread that runs `engine.stream` for one request at a time, a
bounded queue in front of it, cancellation and time limits. `engine.stream` is not
thread-safe, so nothing else ever calls it.

A job's events cross from the worker thread to the event loop through an asyncio.Queue
(`loop.call_soon_threadsafe`). Whoever gives up on a job (client gone, time limit,
shutdown) marks it cancelled; the worker checks the mark between events and closes the
engine's generator, which stops generation before the next decode step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import closing

from qvl.engine import Cancelled, Engine, ParsedRequest
from qvl.server.errors import APIError, internal
from qvl.server.metrics import Metrics
from qvl.stream import Delta, Done

DISCONNECT, TIMEOUT, SHUTDOWN = "disconnect", "timeout", "shutdown"
log = logging.getLogger("qvl.server")


class Job:
    def __init__(self, worker: Worker, parsed: ParsedRequest, time_limit_s: float):
        self.worker, self.parsed, self.time_limit_s = worker, parsed, time_limit_s
        self.submitted = time.monotonic()
        self.deadline = self.submitted + time_limit_s
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[Delta | Done | APIError] = asyncio.Queue()
        self.reason: str | None = None  # why it was cancelled
        self.finished = False

    def put(self, item: Delta | Done | APIError) -> None:
        """Deliver to the consumer; callable from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def failure(self) -> APIError:
        if self.reason == TIMEOUT:
            return APIError(504, f"the request exceeded the server's time limit of {self.time_limit_s:g} s",
                            code="timeout")
        if self.reason == SHUTDOWN:
            return APIError(503, "the server is shutting down", code="shutting_down")
        return APIError(499, "the client closed the request", code="cancelled")

    async def events(self) -> AsyncIterator[Delta | Done]:
        """Deltas then Done; raises APIError on timeout, shutdown or an engine failure.
        Leaving the loop early (client gone, task cancelled) cancels the job."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.inbox.get(), max(0.0, self.deadline - time.monotonic()))
                except TimeoutError:
                    self.worker.cancel(self, TIMEOUT)
                    raise self.failure() from None
                if isinstance(item, APIError):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            self.worker.cancel(self, DISCONNECT)  # a no-op once finished or already cancelled


class Worker:
    def __init__(self, engine: Engine, queue_size: int, metrics: Metrics, warm_up: bool = False):
        self.engine, self.capacity, self.metrics, self.warm_up = engine, queue_size, metrics, warm_up
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.cond = threading.Condition()
        self.closing = self.stopped = False
        self.avg_job_s = 1.0  # moving average, for Retry-After
        self.thread = threading.Thread(target=self._loop, name="qvl-engine-worker", daemon=True)

    @property
    def depth(self) -> int:
        return len(self.waiting)

    @property
    def busy(self) -> bool:
        return self.running is not None

    @property
    def idle(self) -> bool:
        with self.cond:
            return self.running is None and not self.waiting

    def start(self) -> None:
        self.thread.start()

    def submit(self, parsed: ParsedRequest, time_limit_s: float) -> Job:
        """Queue a request (call on the event loop); raises 429 at once when the queue is full."""
        with self.cond:
            if self.closing:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self.waiting) + (self.running is not None) > self.capacity:  # capacity: may wait behind one
                retry = str(max(1, min(60, math.ceil(self.avg_job_s))))
                raise APIError(429, f"the server is busy: {self.capacity} requests are already waiting; "
                               f"retry in {retry} s", code="queue_full", headers={"Retry-After": retry})
            job = Job(self, parsed, time_limit_s)
            self.waiting.append(job)
            self.cond.notify()
        return job

    def cancel(self, job: Job, reason: str) -> None:
        """Stop a job: a waiting one leaves the queue now, a running one before its next step."""
        with self.cond:
            if job.finished or job.reason is not None:
                return
            job.reason = reason
            self.metrics.count_cancel(reason)
            if job in self.waiting:
                self.waiting.remove(job)
                job.put(job.failure())

    def close(self, grace_s: float) -> None:
        """Shutdown, step 1: refuse new work; cancel whatever is left after `grace_s`."""
        with self.cond:
            self.closing = True
        timer = threading.Timer(grace_s, self.cancel_all)
        timer.daemon = True
        timer.start()

    def cancel_all(self) -> None:
        with self.cond:
            jobs = list(self.waiting) + ([self.running] if self.running else [])
        for job in jobs:
            self.cancel(job, SHUTDOWN)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shutdown, step 2: cancel everything and end the thread."""
        with self.cond:
            self.closing = True
        self.cancel_all()
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout_s)

    # -- the worker thread -----------------------------------------------------------------

    def _loop(self) -> None:
        if self.warm_up:  # the server is already ready: requests arriving meanwhile wait in the queue
            try:
                log.info("warm-up done in %.1f s", self.engine.warm_up())
            except Exception:  # only a lost optimisation: serve anyway
                log.exception("warm-up failed")
        while (job := self._next()) is not None:
            started = time.monotonic()
            self._run(job)
            with self.cond:
                self.running = None
                self.avg_job_s = 0.8 * self.avg_job_s + 0.2 * (time.monotonic() - started)

    def _next(self) -> Job | None:
        with self.cond:
            while not self.waiting and not self.stopped:
                self.cond.wait()
            if self.stopped:
                return None
            self.running = self.waiting.popleft()
        self.metrics.observe_wait(time.monotonic() - self.running.submitted)
        return self.running

    def _run(self, job: Job) -> None:
        try:
            stop = lambda: job.reason is not None or time.monotonic() > job.deadline  # noqa: E731
            with closing(self.engine.stream(job.parsed, cancel=stop)) as events:
                for event in events:
                    if time.monotonic() > job.deadline:
                        self.cancel(job, TIMEOUT)
                    if job.reason is not None:
                        job.put(job.failure())
                        return
                    if isinstance(event, Done):
                        with self.cond:
                            job.finished = True
                        self.metrics.record(event)
                    job.put(event)
        except Cancelled:  # the engine stopped between two steps (disconnect, time limit, shutdown)
            if job.reason is None:
                self.cancel(job, TIMEOUT)
            job.put(job.failure())
        except Exception as exc:  # a failing request must not take the worker down
            with self.cond:
                job.finished = True  # answered (with a 500): not a cancellation
            job.put(internal(exc))
