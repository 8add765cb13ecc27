"""An engine's worker (one per loaded model, see registry.py): a thread that drives the
engine's scheduler, which decodes every running request together (up to --max-batch of them)
and admits waiting ones between decode steps; a bounded queue in front of it, cancellation and
time limits. Nothing else ever drives the scheduler.

A job's events cross from the worker thread to the event loop through an asyncio.Queue
(`loop.call_soon_threadsafe`). Whoever gives up on a job (client gone, time limit,
shutdown) marks it cancelled; the scheduler drops it before its next step.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import AsyncIterator

from qvl.engine import Cancelled, Engine, ParsedRequest
from qvl.scheduler import Sequence
from qvl.server.errors import APIError, internal
from qvl.server.memory import release
from qvl.server.metrics import Metrics
from qvl.stream import Delta, Done

DISCONNECT, TIMEOUT, SHUTDOWN = "disconnect", "timeout", "shutdown"
STATUS_EVERY_S = 10.0  # a one-line status in the log while requests run
IDLE_RELEASE_S = 1.0  # idle this long after work, the worker hands freed memory back to the system
log = logging.getLogger("qvl.server")


class Job:
    def __init__(self, worker: Worker, parsed: ParsedRequest, time_limit_s: float):
        self.worker, self.parsed, self.time_limit_s = worker, parsed, time_limit_s
        self.submitted = time.monotonic()
        self.deadline = self.submitted + time_limit_s
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[Delta | Done | APIError] = asyncio.Queue()
        self.reason: str | None = None  # why it was cancelled
        self.started = self.finished = False
        self.answers = 0  # Done events so far, of parsed.sampling.n
        # None once the scheduler has ended it: its callbacks hold this job, and the cycle would keep
        # its tensors (logits, the prompt, the constraint) until Python's next full collection
        self.seq: Sequence | None = Sequence(parsed, self.on_event, cancel=self.should_stop, on_start=self.on_start)

    def put(self, item: Delta | Done | APIError) -> None:
        """Deliver to the consumer; callable from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def should_stop(self) -> bool:
        if self.reason is None and time.monotonic() > self.deadline:
            self.worker.cancel(self, TIMEOUT)
        return self.reason is not None

    def on_start(self) -> None:
        self.started = True
        self.worker.metrics.observe_wait(time.monotonic() - self.submitted)

    def on_event(self, event) -> None:
        """The scheduler's events for this job (on the worker thread)."""
        if isinstance(event, Done):
            self.answers += 1
            self.worker.metrics.record(event)
            if self.answers == self.parsed.sampling.n:
                with self.worker.cond:
                    self.finished = True
                    self.seq = None
                self.worker.finished(self)
            self.put(event)
        elif isinstance(event, Cancelled):  # stopped between two steps (disconnect, time limit, shutdown)
            if self.reason is None:
                self.worker.cancel(self, TIMEOUT)
            with self.worker.cond:
                self.seq = None
            if self.started:  # a job cancelled while waiting was answered by `cancel`
                self.put(self.failure())
        elif isinstance(event, BaseException):  # a failing request must not take the others down
            with self.worker.cond:
                self.finished = True  # answered (with an error): not a cancellation
                self.seq = None
                if self in self.worker.jobs:
                    self.worker.jobs.remove(self)
            self.put(internal(event))
        elif self.reason is None:
            self.put(event)

    def failure(self) -> APIError:
        if self.reason == TIMEOUT:
            return APIError(504, f"the request exceeded the server's time limit of {self.time_limit_s:g} s",
                            code="timeout")
        if self.reason == SHUTDOWN:
            return APIError(503, "the server is shutting down", code="shutting_down")
        return APIError(499, "the client closed the request", code="cancelled")

    async def events(self) -> AsyncIterator[Delta | Done]:
        """Deltas then Done (for n answers: interleaved, each with its `index`, until the n-th
        Done); raises APIError on timeout, shutdown or an engine failure. Leaving the loop
        early (client gone, task cancelled) cancels the job."""
        answers = 0
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.inbox.get(), max(0.0, self.deadline - time.monotonic()))
                except TimeoutError:
                    self.worker.cancel(self, TIMEOUT)
                    raise self.failure() from None
                if isinstance(item, APIError):
                    try:
                        raise item
                    finally:
                        item = None  # its traceback holds this frame
                yield item
                answers += isinstance(item, Done)
                if answers == self.parsed.sampling.n:
                    return
        finally:
            self.worker.cancel(self, DISCONNECT)  # a no-op once finished or already cancelled


class Worker:
    def __init__(self, engine: Engine, queue_size: int, metrics: Metrics, warm_up: bool = False):
        self.engine, self.capacity, self.metrics, self.warm_up = engine, queue_size, metrics, warm_up
        self.scheduler = engine.scheduler
        self.jobs: list[Job] = []  # submitted, not yet answered or cancelled
        self.cond = threading.Condition()
        self.closing = self.stopped = False
        self.avg_job_s = 1.0  # moving average, for Retry-After
        self.thread = threading.Thread(target=self._loop, name="qvl-engine-worker", daemon=True)

    @property
    def depth(self) -> int:
        """Requests waiting to be admitted."""
        with self.cond:
            return sum(not j.started for j in self.jobs)

    @property
    def running(self) -> int:
        with self.cond:
            return sum(j.started for j in self.jobs)

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def idle(self) -> bool:
        with self.cond:
            return not self.jobs

    def start(self) -> None:
        self.thread.start()

    def submit(self, parsed: ParsedRequest, time_limit_s: float) -> Job:
        """Queue a request (call on the event loop); raises 429 at once when the queue is full."""
        with self.cond:
            if self.closing:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            waiting = sum(not j.started for j in self.jobs)
            free_rows = self.scheduler.max_batch - sum(j.started for j in self.jobs)
            if waiting - max(0, free_rows) >= self.capacity:  # capacity: may wait behind the running ones
                retry = str(max(1, min(60, math.ceil(self.avg_job_s))))
                raise APIError(429, f"the server is busy: {self.capacity} requests are already waiting; "
                               f"retry in {retry} s", code="queue_full", headers={"Retry-After": retry})
            job = Job(self, parsed, time_limit_s)
            self.jobs.append(job)
            self.scheduler.submit(job.seq)
            self.cond.notify()
        return job

    def cancel(self, job: Job, reason: str) -> None:
        """Stop a job: the scheduler drops it before its next step (a waiting one included)."""
        with self.cond:
            if job.finished or job.reason is not None:
                return
            job.reason = reason
            if job in self.jobs:
                self.jobs.remove(job)
            self.metrics.count_cancel(reason)
            self.scheduler.stop(job.seq, reason)
            self.cond.notify()
        if not job.started:  # not admitted yet: answer now, not after the running step
            job.put(job.failure())

    def finished(self, job: Job) -> None:
        with self.cond:
            if job in self.jobs:
                self.jobs.remove(job)
            self.avg_job_s = 0.8 * self.avg_job_s + 0.2 * (time.monotonic() - job.submitted)

    def close(self, grace_s: float) -> None:
        """Shutdown, step 1: refuse new work; cancel whatever is left after `grace_s`."""
        with self.cond:
            self.closing = True
        timer = threading.Timer(grace_s, self.cancel_all)
        timer.daemon = True
        timer.start()

    def cancel_all(self) -> None:
        with self.cond:
            jobs = list(self.jobs)
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
        # the model, the libraries, the app live as long as the process: out of the collector's
        # sight, a full collection (`release`) walks only what requests left (~ms, not the 0.3 s
        # of the ~200,000 objects a loaded model leaves, with the event loop waiting on the GIL)
        gc.freeze()
        last_status, tokens = time.monotonic(), self.scheduler.tokens
        released = True  # nothing ran since memory was last handed back
        while True:
            with self.cond:
                work = self.cond.wait_for(lambda: self.stopped or not self.scheduler.idle,
                                          None if released else IDLE_RELEASE_S)
                if self.stopped:
                    return
            if not work:  # an idle server's memory is what its caches and the model hold
                release()
                released = True
                continue
            try:
                self.scheduler.step()
            except Exception:  # the scheduler answers each request's own failures; this is its own
                log.exception("scheduler step failed")
            released = False
            if (now := time.monotonic()) - last_status >= STATUS_EVERY_S:
                stats = self.scheduler.stats()
                log.info("running %d/%d, waiting %d, %.1f tokens/s, KV pool %.0f of %.0f MB held "
                         "(%.0f MB prefix cache), %d preemptions",
                         stats["running"], self.scheduler.max_batch, stats["waiting"],
                         (stats["tokens"] - tokens) / (now - last_status), stats["kv_held_bytes"] / 2**20,
                         stats["kv_budget_bytes"] / 2**20, stats["kv_prefix_bytes"] / 2**20, stats["preemptions"])
                last_status, tokens = now, stats["tokens"]
