"""The retrieval routes of an embedding or reranker model: OpenAI's POST /v1/embeddings,
Cohere/Jina's POST /v1/rerank (as vLLM serves it, also at /rerank and /v2/rerank), vLLM's
POST /v1/score and Ollama's POST /api/embed. Each input (or query-document pair) is a request
of its own on the worker, which ends after its prefill (qvl.retrieval.encode); at most the
scheduler's rows of them are queued at a time, so a long list does not fill the queue."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from qvl.deadline import Deadline
from qvl.engine import Engine, ParsedRequest
from qvl.requests import RequestError
from qvl.retrieval.encode import check_dimensions, embedding, parse_embedding, parse_pair, relevance, score_vector
from qvl.retrieval.task import EMBED, RERANK, wrong_task
from qvl.server.errors import APIError, from_exception
from qvl.server.guard import cache_salt
from qvl.server.openai import engine_messages
from qvl.server.schemas import (MAX_INPUTS, EmbeddingRequest, Message, OllamaEmbedRequest, RerankRequest,
                                ScoreRequest)
from qvl.server.state import ServerState
from qvl.server.submit import Submitter, client_gone, disconnected, keep_alive_of
from qvl.server.worker import DISCONNECT, Job, Worker
from qvl.stream import Done

Parts = list[dict]  # an input as the engine takes it: content parts
OBJECT_KEYS = {"text": "text", "image": "image_url", "video": "video_url"}  # Jina's / the reference's object form


class Retrieval:
    def __init__(self, state: ServerState, submit: Submitter):
        self.state, self.submit = state, submit

    async def embeddings(self, http: HTTPRequest) -> JSONResponse:
        req, dones, engine = await self._run(http, EmbeddingRequest, self._prepare_embeddings)
        vectors = [embedding(d.hidden, req.dimensions) for d in dones]
        data = [{"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = prompt_tokens(dones)
        return JSONResponse({"object": "list", "data": data, "model": req.model or engine.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def rerank(self, http: HTTPRequest) -> JSONResponse:
        (req, labels), dones, engine = await self._run(http, RerankRequest, self._prepare_rerank)
        vector = score_vector(engine)
        scores = [relevance(d.hidden, vector) for d in dones]
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [{"index": i, "relevance_score": scores[i]} | ({"document": {"text": labels[i]}}
                   if req.return_documents and labels[i] is not None else {}) for i in ranked]
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": req.model or engine.model_name,
                             "usage": {"total_tokens": prompt_tokens(dones)}, "results": results})

    async def score(self, http: HTTPRequest) -> JSONResponse:
        req, dones, engine = await self._run(http, ScoreRequest, self._prepare_score)
        vector = score_vector(engine)
        data = [{"index": i, "object": "score", "score": relevance(d.hidden, vector)} for i, d in enumerate(dones)]
        tokens = prompt_tokens(dones)
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": req.model or engine.model_name, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def ollama_embed(self, http: HTTPRequest) -> JSONResponse:
        started = time.perf_counter()
        req, dones, engine = await self._run(http, OllamaEmbedRequest, self._prepare_ollama, json_only=False)
        return JSONResponse({"model": req.model or engine.model_name,
                             "embeddings": [embedding(d.hidden, req.dimensions).tolist() for d in dones],
                             "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                             "prompt_eval_count": prompt_tokens(dones)})

    # -- reading and preparing ---------------------------------------------------------------

    async def _run(self, http: HTTPRequest, schema, prepare: Callable, json_only: bool = True):
        """The body read and checked, then answered on the model it names (`_answer`)."""
        req, key = await self._read(http, schema, json_only)
        return await self._answer(http, req, self.model_for(req), key, prepare)

    async def _read(self, http: HTTPRequest, schema, json_only: bool = True) -> tuple[Any, str | None]:
        """The body checked against `schema`, and the API key the caller presented."""
        body, key = await self.submit.receive(http, json_only)
        try:
            return await asyncio.to_thread(schema.model_validate_json, body), key
        except Exception as exc:
            raise from_exception(exc) from None

    async def _answer(self, http: HTTPRequest, req: Any, model: str | None, key: str | None, prepare: Callable,
                      media: bool | None = None):
        """Every input of `req` prepared by `prepare(req, engine, deadline, salt)` in a thread of
        the preparing lanes (of images and videos when `media`, by default when the request
        holds any; 400 before anything is queued), then answered on the named model's worker:
        (what `prepare` returned beside the requests, their Done events in order, the engine)."""
        lease = None
        try:
            lease = await self.state.acquire(model, keep_alive_of(req))
            salt, engine = cache_salt(key, req.cache_salt), lease.engine
            spec, parsed = await self.submit.in_lane(http, has_media(req) if media is None else media,
                                                      lambda deadline: prepare(req, engine, deadline, salt))
            return spec, await answers(lease.worker, parsed, self.state.settings.time_limit_s, http), engine
        except Exception as exc:
            raise from_exception(exc) from None
        finally:
            if lease is not None:
                lease.release()

    def model_for(self, req: Any) -> str | None:
        """The name of the model that answers `req`."""
        return req.model

    def _parts(self, value: Any, param: str, engine: Engine) -> Parts:
        """An input, query or document as content parts: a string, a list of chat content
        parts (image_url and video_url fetched or decoded as in chat), or an object with
        "text", "image", "video"."""
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if isinstance(value, dict) and value and set(value) <= set(OBJECT_KEYS):
            value = [{"type": "text", "text": v} if kind == "text" else
                     {"type": OBJECT_KEYS[kind], OBJECT_KEYS[kind]: {"url": v}} for kind, v in value.items()]
        if not isinstance(value, list):
            raise RequestError("expected a string, a list of content parts, or an object with text, image or video",
                               param)
        try:
            message = Message.model_validate({"role": "user", "content": value})
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            raise RequestError(f"{first['msg'].removeprefix('Value error, ')}", param) from None
        options = engine.options
        try:
            converted = engine_messages([message], self.state.settings.images, options.max_images, options.max_videos)
            return converted[0]["content"]
        except APIError as exc:
            exc.param = param + (exc.param or "").removeprefix("messages[0].content")
            raise

    def _prepare_embeddings(self, req: EmbeddingRequest, engine: Engine, deadline: Deadline, salt: str):
        require_task(engine, EMBED)
        check_dimensions(req.dimensions, engine.cfg.text.hidden_size)
        if (req.input is None) == (req.messages is None):
            raise RequestError("give either input (texts, or inputs of content parts) or messages", "input")
        if req.messages is not None:
            instruction, parts = self._conversation(req.messages, engine)
            inputs, instruction = [("messages", parts)], instruction or req.instruction
        else:
            inputs = [(param, self._parts(v, param, engine)) for param, v in input_list(req.input)]
            instruction = req.instruction
        return req, [parsed_as(param, lambda: parse_embedding(engine, parts, instruction, deadline, salt))
                     for param, parts in inputs]

    def _conversation(self, messages: list[Message], engine: Engine) -> tuple[str | None, Parts]:
        """vLLM's chat form of one input: a system message's text is the instruction, the user
        messages' parts are the input."""
        converted = engine_messages(messages, self.state.settings.images, engine.options.max_images,
                                    engine.options.max_videos)
        instruction, parts = None, []
        for i, message in enumerate(converted):
            if message["role"] == "system":
                instruction = "".join(p["text"] for p in message["content"])
            elif message["role"] == "user":
                parts += message["content"]
            else:
                raise RequestError("an embedding input is a system message (the instruction) and user messages",
                                   f"messages[{i}].role")
        return instruction, parts

    def _prepare_rerank(self, req: RerankRequest, engine: Engine, deadline: Deadline, salt: str):
        require_task(engine, RERANK)
        documents = req.documents
        if isinstance(documents, dict) and "content" in documents:  # vLLM: each part a document
            documents = [[part] for part in documents["content"]] if isinstance(documents["content"], list) else None
        if not isinstance(documents, list) or not 1 <= len(documents) <= MAX_INPUTS:
            raise RequestError(f"documents must be a list of 1 to {MAX_INPUTS} documents", "documents")
        query = self._parts(req.query["content"] if isinstance(req.query, dict) and "content" in req.query
                            else req.query, "query", engine)
        parsed = [parsed_as(f"documents[{i}]", lambda doc=doc, i=i: parse_pair(
            engine, query, self._parts(doc, f"documents[{i}]", engine), req.instruction, deadline, salt))
            for i, doc in enumerate(documents)]
        return (req, [text_of(doc) for doc in documents]), parsed

    def _prepare_score(self, req: ScoreRequest, engine: Engine, deadline: Deadline, salt: str):
        require_task(engine, RERANK)
        queries, documents = (v if isinstance(v, list) and not is_parts(v) else [v] for v in (req.text_1, req.text_2))
        if len(queries) != 1 and len(queries) != len(documents):
            raise RequestError(f"text_1 has {len(queries)} items and text_2 {len(documents)}: give one text_1, or as "
                               "many as text_2", "text_1")
        if not 1 <= len(documents) <= MAX_INPUTS:
            raise RequestError(f"text_2 must hold 1 to {MAX_INPUTS} items", "text_2")
        pairs = [(0 if len(queries) == 1 else i, i) for i in range(len(documents))]
        query_parts = [self._parts(q, f"text_1[{i}]", engine) for i, q in enumerate(queries)]
        return req, [parsed_as(f"text_2[{d}]", lambda q=q, d=d: parse_pair(
            engine, query_parts[q], self._parts(documents[d], f"text_2[{d}]", engine), req.instruction, deadline, salt))
            for q, d in pairs]

    def _prepare_ollama(self, req: OllamaEmbedRequest, engine: Engine, deadline: Deadline, salt: str):
        require_task(engine, EMBED)
        check_dimensions(req.dimensions, engine.cfg.text.hidden_size)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts:
            raise RequestError("input must hold at least one text", "input")
        return req, [parsed_as(f"input[{i}]", lambda t=t: parse_embedding(engine, [{"type": "text", "text": t}],
                                                                           None, deadline, salt))
                     for i, t in enumerate(texts)]


def register(api: APIRouter, state: ServerState, submit: Submitter) -> None:
    """The retrieval routes on the API router."""
    routes = Retrieval(state, submit)
    api.add_api_route("/v1/embeddings", routes.embeddings, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        api.add_api_route(path, routes.rerank, methods=["POST"])
    api.add_api_route("/v1/score", routes.score, methods=["POST"])
    api.add_api_route("/api/embed", routes.ollama_embed, methods=["POST"])


# -- helpers ------------------------------------------------------------------------------------

def require_task(engine: Engine, task: str) -> None:
    """400 naming "model" before any image is fetched, when the model is not for `task`."""
    if engine.task != task:
        raise wrong_task(engine.model_name, engine.task, task)


def is_parts(value: Any) -> bool:
    """A list of content parts (one multimodal input), not a list of inputs."""
    return isinstance(value, list) and bool(value) and all(isinstance(p, dict) and "type" in p for p in value)


def input_list(value: Any) -> list[tuple[str, Any]]:
    """(param, input) of each input of `input`: a string, a list of content parts, or a list
    of either; token ids are refused (they are another tokenizer's)."""
    items = [value] if isinstance(value, str) or is_parts(value) else value
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_INPUTS:
        raise RequestError(f"input must be a string, or a list of 1 to {MAX_INPUTS} inputs", "input")
    if any(isinstance(v, int) or (isinstance(v, list) and v and all(isinstance(t, int) for t in v)) for v in items):
        raise RequestError("token ids are not accepted (they are another tokenizer's): send the texts (LangChain's "
                           "OpenAIEmbeddings: check_embedding_ctx_length=False)", "input")
    return [("input" if len(items) == 1 and items is not value else f"input[{i}]", v) for i, v in enumerate(items)]


def parsed_as(param: str, parse: Callable[[], ParsedRequest]) -> ParsedRequest:
    """`parse()`, its errors about the prompt named after the input they came from."""
    try:
        return parse()
    except RequestError as exc:
        if exc.param is None or exc.param.startswith("messages"):
            exc.param = param
        raise


def has_media(req: Any) -> bool:
    """Whether anything but plain strings came: it prepares in the lane for images and videos."""
    values = [getattr(req, name, None) for name in ("input", "messages", "query", "documents", "text_1", "text_2")]
    return any(v is not None and not (isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v))
               for v in values)


def text_of(document: Any) -> str | None:
    """A document's text to return beside its score (None for one without text)."""
    if isinstance(document, str):
        return document
    if isinstance(document, dict):
        return document.get("text")
    texts = [p.get("text") for p in document if isinstance(p, dict) and p.get("type") == "text"] \
        if isinstance(document, list) else []
    return "".join(texts) if texts else None


def encoded(vector, encoding_format: str):
    """A vector as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def prompt_tokens(dones: list[Done]) -> int:
    return sum(d.usage.prompt_tokens for d in dones)


async def answers(worker: Worker, parsed: list[ParsedRequest], time_limit_s: float, http: HTTPRequest) -> list[Done]:
    """Each request's Done, in order. At most the scheduler's rows of them wait or run at a
    time; past that they are queued as earlier ones finish (a full queue refuses the first
    with 429, not the later ones). The client leaving (499), or any request failing, cancels
    the rest."""
    results: list[Done | None] = [None] * len(parsed)
    waiting, running = deque(range(len(parsed))), {}
    gone = asyncio.ensure_future(disconnected(http))
    try:
        while waiting or running:
            while waiting and len(running) < worker.scheduler.max_batch:
                try:
                    job = worker.submit(parsed[waiting[0]], time_limit_s)
                except APIError as exc:
                    if exc.status != 429 or not running:
                        raise
                    break
                running[asyncio.ensure_future(final(job))] = (waiting.popleft(), job)
            finished, _ = await asyncio.wait({*running, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in finished:
                raise client_gone()
            for task in finished:
                index, _ = running.pop(task)
                results[index] = task.result()
    finally:
        for task, (_, job) in running.items():
            task.cancel()
            worker.cancel(job, DISCONNECT)
        gone.cancel()
        await asyncio.gather(gone, *running, return_exceptions=True)
    return results


async def final(job: Job) -> Done:
    async for event in job.events():
        if isinstance(event, Done):
            return event
    raise RuntimeError("the request ended without an answer")
