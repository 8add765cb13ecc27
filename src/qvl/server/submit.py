"""What every API route shares between reading a body and writing its own wire format: the
body checked and turned into an engine request in a thread (so bad input is a 400 before
anything is queued, streaming or not), then an exact repeat answered from the answer cache
or a job on the worker, and the events back.

Preparing (decoding images and videos, tokenizing) runs in two lanes of `parse_slots`
threads each, one for requests with images or videos and one for requests without, so text
never waits behind media. A preparation has `parse_timeout_s` (its thread checks a Deadline
between packets, images and steps), and a client that leaves cancels its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from qvl.deadline import Deadline
from qvl.engine import Engine, ParsedRequest
from qvl.server.errors import APIError, bad_request, from_exception
from qvl.server.guard import cache_salt, matching_key
from qvl.server.memory import LARGE_BODY_BYTES, trim
from qvl.server.registry import DEFAULT, Lease
from qvl.server.settings import MB, keep_alive_s
from qvl.server.state import ServerState
from qvl.server.worker import DISCONNECT, Job
from qvl.stream import Delta, Done

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering

# body -> (the route's request, whether it carries images or videos); the request has `cache_salt`
Read = Callable[[bytes], tuple[Any, bool]]
# (the route's request, engine, deadline, the engine's cache salt for it) -> (its spec, parsed); parsed
# None: nothing to generate (the request only loads its model)
Prepare = Callable[[Any, Engine, Deadline, str], tuple[Any, ParsedRequest | None]]


@dataclass
class Submission:
    spec: Any  # what the route's `prepare` made of the body
    parsed: ParsedRequest | None  # None: nothing to generate, no events
    events: AsyncIterator[Delta | Done]
    on_close: Callable[[], None]  # cancels the job (a no-op once it finished) and lets go of the model
    engine: Engine

    async def finals(self, http: HTTPRequest) -> list[Done]:
        """The n Done events, unless the client leaves first (the job is cancelled then)."""
        try:
            return await finals_or_disconnect(self.events, http, self.parsed.sampling.n)
        finally:
            self.on_close()


class Submitter:
    def __init__(self, state: ServerState):
        self.state = state
        slots = state.settings.parse_slots
        self.lanes = {True: asyncio.Semaphore(slots), False: asyncio.Semaphore(slots)}  # with media, without
        self.threads = ThreadPoolExecutor(2 * slots, thread_name_prefix="qvl-prepare")  # one per slot: none queues

    async def receive(self, http: HTTPRequest, json_only: bool = True) -> tuple[bytes, str | None]:
        """The request's body (within --max-body-bytes; JSON unless not `json_only`) and the
        API key the caller presented (its cache namespace); 503 while the server is not ready."""
        if json_only:
            require_json(http)
        settings = self.state.settings
        body = await read_body(http, settings.max_body_bytes)
        self.state.ready()
        return body, matching_key(http.headers.get("authorization", ""), settings.api_keys)

    async def __call__(self, http: HTTPRequest, read: Read, prepare: Prepare, json_only: bool = True) -> Submission:
        """json_only: refuse bodies not sent as application/json (Ollama's routes take what
        `curl -d` sends too; the browser guard still refuses foreign pages). The model the
        request names is held until its answer is out (Submission.on_close)."""
        body, key = await self.receive(http, json_only)
        settings, request, media, lease = self.state.settings, None, False, None
        try:
            request, media = await asyncio.to_thread(read, body)
            lease = await self.state.acquire(request.model, keep_alive_of(request))
            salt, engine = cache_salt(key, request.cache_salt), lease.engine
            spec, parsed, cached = await self.in_lane(
                http, media, lambda deadline: self._prepare(prepare, request, engine, deadline, salt))
            job = lease.worker.submit(parsed, settings.time_limit_s) if parsed is not None and cached is None else None
        except BaseException as exc:
            if lease is not None:
                lease.release()
            if isinstance(exc, Exception):
                raise from_exception(exc) from None
            raise
        finally:
            if media or len(body) >= LARGE_BODY_BYTES:
                body = request = None  # what the trim may give back
                await asyncio.to_thread(trim)
        if job is not None:
            events, on_close = job.events(), partial(end_job, job, lease)
        else:  # an exact repeat, answered without waiting in the queue; or nothing to generate
            if cached is not None:
                self.state.metrics.record(cached, cached=True)
            events, on_close = replay(cached), lease.release
        return Submission(spec, parsed, without_cache_stats(events) if settings.hide_cache_stats else events,
                          on_close, engine)

    async def in_lane(self, http: HTTPRequest, media: bool, work: Callable[[Deadline], Any]) -> Any:
        """`work(deadline)` on a thread of its lane, once a slot is free; the slot stays taken
        until the thread ends. The client leaving (499) cancels the deadline: the thread stops
        at its next check."""
        lane = self.lanes[media]
        gone = asyncio.ensure_future(disconnected(http))
        try:
            await self._take(lane, gone, media)
            deadline = Deadline(self.state.settings.parse_timeout_s)
            job = self.threads.submit(work, deadline)
            job.add_done_callback(releaser(lane))
            result = asyncio.wrap_future(job)
            try:
                await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not result.done():
                    raise client_gone()
                return result.result()
            finally:
                deadline.cancel()  # a no-op once the work ended
                result.cancel()
                job = result = None  # they hold its failure, whose traceback holds this frame
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)

    async def _take(self, lane: asyncio.Semaphore, gone: asyncio.Future, media: bool) -> None:
        """A slot of `lane`: 499 if the client leaves first, 503 if none comes free within the
        preparation time limit."""
        wait = self.state.settings.parse_timeout_s
        slot = asyncio.ensure_future(lane.acquire())
        await asyncio.wait({slot, gone}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        if slot.done():
            return
        slot.cancel()  # (a slot granted meanwhile is handed on by the semaphore)
        if gone.done():
            raise client_gone()
        kind = "with images or videos" if media else "without images or videos"
        raise APIError(503, f"the server is busy preparing other requests {kind}: no slot came free within "
                            f"{wait:g} s", code="server_busy", headers={"Retry-After": "5"})

    @staticmethod
    def _prepare(prepare: Prepare, request: Any, engine: Engine, deadline: Deadline, salt: str):
        spec, parsed = prepare(request, engine, deadline, salt)
        return spec, parsed, engine.cached_answer(parsed) if parsed is not None else None


def end_job(job: Job, lease: Lease) -> None:
    """The answer is out, or nobody waits for it any more: cancel the job (a no-op once it
    finished) and let go of its model."""
    job.worker.cancel(job, DISCONNECT)
    lease.release()


def keep_alive_of(request: Any) -> object:
    """A request's keep_alive (Ollama's routes) in seconds, None for ever; DEFAULT when it sets none."""
    value = getattr(request, "keep_alive", None)
    if value is None:
        return DEFAULT
    try:
        return keep_alive_s(value)
    except ValueError as exc:
        raise bad_request(str(exc), "keep_alive") from None


def releaser(lane: asyncio.Semaphore) -> Callable[[Future], None]:
    """A done callback for a thread's future that gives its slot back on the event loop."""
    loop = asyncio.get_running_loop()

    def release(_: Future) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits for the slot
            loop.call_soon_threadsafe(lane.release)

    return release


def client_gone() -> APIError:
    return APIError(499, "the client closed the request", code="cancelled")


def require_json(http: HTTPRequest) -> None:
    """API bodies must say they are JSON: a browser may send text/plain or a form to any site
    without asking first, never application/json."""
    media_type = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = f"'{media_type}'" if media_type else "none"
        raise APIError(415, f"the body must be sent with 'Content-Type: application/json' (got {shown})",
                       code="unsupported_media_type")


async def read_body(http: HTTPRequest, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = APIError(413, f"the request body exceeds the limit of {limit / MB:g} MB", code="body_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for piece in http.stream():
            size += len(piece)
            if size > limit:
                raise too_large
            chunks.append(piece)
    except ClientDisconnect:
        raise client_gone() from None
    return b"".join(chunks)


async def replay(done: Done | None) -> AsyncIterator[Delta | Done]:
    """A whole answer as the events that made it (none for None)."""
    if done is None:
        return
    if done.text or done.reasoning:
        yield Delta(done.text, done.token_ids, done.logprobs, reasoning=done.reasoning or "")
    yield done


async def without_cache_stats(events: AsyncIterator[Delta | Done]) -> AsyncIterator[Delta | Done]:
    """The events with what the caches gave blanked out of each Done: cached {}, reused_tokens 0."""
    async with contextlib.aclosing(events):  # left early: the job's events end (and cancel it) at once
        async for event in events:
            if isinstance(event, Done):
                event = replace(event, timings=replace(event.timings, cached={}, reused_tokens=0))
            yield event


async def finals_or_disconnect(events: AsyncIterator[Delta | Done], http: HTTPRequest, n: int) -> list[Done]:
    """The n Done events (by index), unless the client goes away first (then the generation
    is cancelled)."""

    async def final() -> list[Done]:
        dones = [event async for event in events if isinstance(event, Done)]
        if len(dones) != n:
            raise RuntimeError("generation ended without a final event")
        return sorted(dones, key=lambda d: d.index)

    answer, gone = asyncio.ensure_future(final()), asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer.done():
            return answer.result()
        raise client_gone()
    finally:
        for task in (answer, gone):
            task.cancel()
        await asyncio.gather(answer, gone, return_exceptions=True)
        answer = gone = None  # they hold a failure, whose traceback holds this frame


async def disconnected(http: HTTPRequest) -> None:
    """Returns once the client has gone (its body already read)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A streamed response (SSE by default) that runs `on_close` however it ends (done,
    client gone, error), so a queued job is never left behind."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None], media_type: str = "text/event-stream"):
        super().__init__(chunks, media_type=media_type, headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
