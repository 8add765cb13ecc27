"""POST /v1/chat/completions: an OpenAI request -> an engine Request -> a `chat.completion`,
or Server-Sent Events of `chat.completion.chunk` objects exactly as OpenAI sends them.

Everything that can reject a request (JSON, types, images, the context budget) runs before
the request is queued, so bad input gets a 400 even when `stream` is true."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from qvl.engine import Engine, ParsedRequest, Request, RequestError
from qvl.processing.image import ImageError
from qvl.sampling import SamplingParams
from qvl.server.errors import APIError, bad_request, from_exception
from qvl.server.images import load_image_bytes
from qvl.server.schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                Choice, ChunkChoice, Usage)
from qvl.server.settings import MB, ImagePolicy
from qvl.server.state import ServerState
from qvl.server.worker import DISCONNECT
from qvl.stream import Delta, Done, TokenLogprob

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


@dataclass(frozen=True)
class Meta:
    """What every chunk of one completion repeats."""

    id: str
    created: int
    model: str
    tokenizer: object  # token ids -> text and bytes, for logprobs


class ChatCompletions:
    def __init__(self, state: ServerState):
        self.state = state
        self.slots = asyncio.Semaphore(state.settings.parse_slots)

    async def __call__(self, http: HTTPRequest) -> Response:
        require_json(http)
        body = await read_body(http, self.state.settings.max_body_bytes)
        engine, worker = self.state.ready()
        try:
            async with self.slots:
                req, parsed, cached = await asyncio.to_thread(self.prepare, body, engine)
        except Exception as exc:
            raise from_exception(exc) from None
        meta = Meta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), engine.model_name, engine.tokenizer)
        if cached is not None:  # an exact repeat, answered without waiting in the queue
            self.state.metrics.record(cached, cached=True)
            events, on_close = replay(cached), lambda: None
        else:
            job = worker.submit(parsed, self.state.settings.time_limit_s)
            events, on_close = job.events(), lambda: worker.cancel(job, DISCONNECT)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(sse(events, meta, include_usage, req.n), on_close)
        try:
            dones = await finals_or_disconnect(events, http, req.n)
        finally:
            on_close()
        return JSONResponse(completion(dones, meta).model_dump())

    def prepare(self, body: bytes, engine: Engine) -> tuple[ChatCompletionRequest, ParsedRequest, Done | None]:
        """Validate, fetch and decode images, tokenize, check the budget (in a thread)."""
        req = ChatCompletionRequest.model_validate_json(body)
        if name := req.unsupported():
            raise bad_request(f"'{name}' is not supported by qvl", name, "unsupported_parameter")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        messages = engine_messages(req, self.state.settings.images, engine.options.max_images)
        try:
            parsed = engine.parse(Request(messages, sampling(req, engine), image_tokens(req, engine)))
        except RequestError as exc:
            if exc.code == "invalid_image" and exc.param and exc.param.endswith("]"):  # the part -> its url
                exc.param += ".image_url.url"
            raise
        lookup = getattr(engine, "cached_answer", None)
        return req, parsed, lookup(parsed) if lookup else None


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
        raise APIError(499, "the client closed the request", code="cancelled") from None
    return b"".join(chunks)


def engine_messages(req: ChatCompletionRequest, policy: ImagePolicy, max_images: int) -> list[dict]:
    """OpenAI messages -> engine messages; image_url parts become image bytes."""
    count = sum(part.type == "image_url" for m in req.messages for part in m.content)
    if count > max_images:
        raise bad_request(f"too many images: {count}; this server takes at most {max_images} per request",
                          "messages", "too_many_images")
    out = []
    for i, message in enumerate(req.messages):
        role = "system" if message.role == "developer" else message.role
        if role == "system" and i > 0:
            raise bad_request("a system message may only come first", f"messages[{i}].role")
        parts = []
        for j, part in enumerate(message.content):
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            elif role != "user":
                raise bad_request("images are only accepted in user messages", f"messages[{i}].content[{j}]")
            else:
                param = f"messages[{i}].content[{j}].image_url.url"
                try:
                    parts.append({"type": "image", "image": load_image_bytes(part.image_url.url, policy)})
                except ImageError as exc:
                    raise bad_request(str(exc), param, "invalid_image") from None
        out.append({"role": role, "content": parts})
    return out


def sampling(req: ChatCompletionRequest, engine: Engine) -> SamplingParams:
    """Request fields over the checkpoint's defaults; max_completion_tokens wins over max_tokens."""
    bias = None
    if req.logit_bias:
        try:
            bias = tuple((int(token), value) for token, value in req.logit_bias.items())
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (as strings of digits)", "logit_bias") from None
    return engine.sampling_defaults(
        max_new_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed,
        stop=tuple(req.stop) if req.stop else None, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos or None,
        logit_bias=bias, logprobs=(req.top_logprobs or 0) if req.logprobs else None, n=req.n)


def image_tokens(req: ChatCompletionRequest, engine: Engine) -> int | None:
    """max_pixels -> a per-image token budget; it may raise or lower the server's default, up
    to the engine's cap (checked when the request is parsed)."""
    if req.max_pixels is None:
        return None
    return max(1, req.max_pixels // engine.image_cfg.factor**2)


# -- answers -----------------------------------------------------------------------------------


async def replay(done: Done) -> AsyncIterator[Delta | Done]:
    if done.text:
        yield Delta(done.text, done.token_ids, done.logprobs)
    yield done


async def finals_or_disconnect(events: AsyncIterator[Delta | Done], http: HTTPRequest, n: int) -> list[Done]:
    """The n Done events (by index), unless the client goes away first (then the generation
    is cancelled)."""

    async def final() -> list[Done]:
        dones = [event async for event in events if isinstance(event, Done)]
        if len(dones) != n:
            raise RuntimeError("generation ended without a final event")
        return sorted(dones, key=lambda d: d.index)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    answer, gone = asyncio.ensure_future(final()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer.done():
            return answer.result()
        raise APIError(499, "the client closed the request", code="cancelled")
    finally:
        for task in (answer, gone):
            task.cancel()
        await asyncio.gather(answer, gone, return_exceptions=True)


def usage(dones: list[Done]) -> Usage:
    """One prompt, every answer's tokens."""
    prompt, completion_tokens = dones[0].usage.prompt_tokens, sum(d.usage.completion_tokens for d in dones)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


def extras(done: Done) -> dict:
    """qvl's own numbers, under an extra "qvl" key."""
    return {"timings": done.to_dict()["timings"], "image_tokens": done.usage.image_tokens}


def logprobs_body(logprobs: list[TokenLogprob] | None, tokenizer) -> dict | None:
    """OpenAI's logprobs object: each token as text and bytes, its logprob, the alternatives."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion(dones: list[Done], meta: Meta) -> ChatCompletion:
    return ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model, usage=usage(dones), qvl=extras(dones[0]),
        choices=[Choice(index=d.index, message=AssistantMessage(content=d.text), finish_reason=d.finish_reason,
                        logprobs=logprobs_body(d.logprobs, meta.tokenizer)) for d in dones])


def chunk(meta: Meta, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None, index: int = 0,
          **extra) -> str:
    choices = ([ChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)]
               if delta is not None else [])
    body = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices, **extra)
    return f"data: {body.model_dump_json()}\n\n"


async def sse(events: AsyncIterator[Delta | Done], meta: Meta, include_usage: bool,
              n: int = 1) -> AsyncIterator[str]:
    """Per answer (index 0..n-1): a role delta, content deltas, its finish_reason chunk; then
    [usage chunk], [DONE]. An error after the headers went out (time limit, shutdown) is sent
    as OpenAI does: data: {"error"}."""
    for index in range(n):
        yield chunk(meta, {"role": "assistant", "content": ""}, index=index)
    dones = []
    try:
        async for event in events:
            if isinstance(event, Delta):
                yield chunk(meta, {"content": event.text}, logprobs=logprobs_body(event.logprobs, meta.tokenizer),
                            index=event.index)
                continue
            dones.append(event)
            yield chunk(meta, {}, event.finish_reason, index=event.index, qvl=extras(event))
        if include_usage:
            yield chunk(meta, None, usage=usage(dones))
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends (done, client gone, error), so a
    queued job is never left behind."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
