"""Ollama's API, so that Ollama clients and the tools built on them connect to qvl unchanged:
POST /api/chat and /api/generate (images as base64, `format` "json" or a JSON schema,
`options`, tools, `keep_alive`; NDJSON streaming, on by default as in Ollama), GET
/api/version. Errors are Ollama's {"error": "..."} (see errors.py). Requests go to the model
they name (registry.py); /api/tags, /api/ps and /api/show are catalog.py's. As in Ollama, a
request with no prompt (no messages) only loads its model, or with keep_alive 0 unloads it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from qvl.deadline import Deadline
from qvl.engine import Engine, ParsedRequest, Request
from qvl.grammar import Constraint
from qvl.processing.image import ImageError
from qvl.server.errors import APIError, bad_request
from qvl.server.images import load_image_bytes
from qvl.server.openai import tool_choice
from qvl.server.schemas import MAX_MESSAGES, CacheSalt, Seed, _Strict
from qvl.server.state import ServerState
from qvl.server.submit import EventStream, Submitter, keep_alive_of
from qvl.stream import Delta, Done
from qvl.tools import TextPiece, ToolCallStream, answer_constraint, check_tool, check_unique, parse_answer

OLLAMA_VERSION = "0.12.0"  # the Ollama API version qvl speaks (clients check it)
NDJSON = "application/x-ndjson"


class Options(_Strict):
    """The sampling options Ollama documents; others (num_ctx, num_thread, mirostat, ...) are
    accepted and ignored, as Ollama ignores what a model does not use."""

    model_config = _Strict.model_config | {"strict": False}  # clients send 1 for 1.0
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    num_predict: int | None = None  # -1 (or -2): up to the context
    seed: Seed = None
    stop: list[str] | None = Field(None, max_length=16)
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class OllamaCall(_Strict):
    function: dict  # {"name", "arguments": {...}}


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(None, max_length=64)  # base64
    tool_calls: list[OllamaCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class Common(_Strict):
    model: str | None = None
    format: Any = None  # "json" or a JSON schema
    options: Options = Options()
    stream: bool = True
    keep_alive: Any = None  # how long the model stays loaded once idle: "5m", seconds, 0 (at once), < 0 (forever)
    think: Any = None
    cache_salt: CacheSalt = None  # qvl's, as on its OpenAI routes


class ChatBody(Common):
    messages: list[OllamaMessage] = Field([], max_length=MAX_MESSAGES)
    tools: list[dict] | None = Field(None, max_length=128)


class GenerateBody(Common):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = Field(None, max_length=64)
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None


@dataclass
class Spec:
    body: ChatBody | GenerateBody
    model: str
    chat: bool
    tools: bool = False

    @property
    def show_thinking(self) -> bool:
        return self.body.think is not False


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Ollama:
    def __init__(self, state: ServerState, submit: Submitter):
        self.state, self.submit = state, submit

    async def chat(self, http: HTTPRequest) -> Response:
        return await self._answer(http, self.read_chat, self.prepare_chat)

    async def generate(self, http: HTTPRequest) -> Response:
        return await self._answer(http, self.read_generate, self.prepare_generate)

    async def _answer(self, http: HTTPRequest, read, prepare) -> Response:
        sub = await self.submit(http, read, prepare, json_only=False)  # as Ollama: `curl -d '{...}'` works
        spec: Spec = sub.spec
        if sub.parsed is None:  # no prompt: the model is loaded (and with keep_alive 0 unloaded once let go)
            sub.on_close()
            reason = "unload" if keep_alive_of(spec.body) == 0 else "load"
            return JSONResponse(line(spec, "", done=True, done_reason=reason))
        if spec.body.stream:
            return EventStream(ndjson(sub.events, spec), sub.on_close, NDJSON)
        done = (await sub.finals(http))[0]
        content, calls = answer_parts(done, spec.tools)
        return JSONResponse(final_line(spec, done, content, calls, done.reasoning or ""))

    # -- requests ----------------------------------------------------------------------------

    @staticmethod
    def read_chat(body: bytes) -> tuple[ChatBody, bool]:
        """The validated body, and whether it carries images."""
        req = ChatBody.model_validate_json(body)
        return req, any(m.images for m in req.messages)

    @staticmethod
    def read_generate(body: bytes) -> tuple[GenerateBody, bool]:
        req = GenerateBody.model_validate_json(body)
        return req, bool(req.images)

    def prepare_chat(self, req: ChatBody, engine: Engine, deadline: Deadline,
                     salt: str) -> tuple[Spec, ParsedRequest | None]:
        """The request to generate; None for no messages (it only loads the model)."""
        if not req.messages:
            return Spec(req, engine.model_name, True), None
        switch = think_switch(req, engine)
        tools = check_unique([tool_from(t, i) for i, t in enumerate(req.tools or [])], "tools")
        constraint = answer_constraint(tools, tool_choice(None, None, tools), True, format_constraint(req.format),
                                       engine.tokenizer)
        if constraint is not None:
            engine.grammars.compile(constraint, "format")
        messages = self.messages(req.messages, engine)
        shown = [t.template_entry() for t in tools] or None
        parsed = engine.parse(Request(messages, sampling(req, engine, constraint), tools=shown, cache_salt=salt,
                                      template_kwargs=switch), deadline)
        return Spec(req, engine.model_name, True, bool(tools)), parsed

    def prepare_generate(self, req: GenerateBody, engine: Engine, deadline: Deadline,
                         salt: str) -> tuple[Spec, ParsedRequest | None]:
        """The request to generate; None for no prompt and no images (it only loads the model)."""
        if not req.prompt and not req.images:
            return Spec(req, engine.model_name, False), None
        for name in ("suffix", "template", "context"):
            if getattr(req, name):
                raise bad_request(f"'{name}' is not supported by qvl", name, "unsupported_parameter")
        if req.raw:
            raise bad_request("raw prompts are not supported by qvl: the checkpoint's chat template is always "
                              "applied", "raw", "unsupported_parameter")
        switch = think_switch(req, engine)
        constraint = format_constraint(req.format)
        if constraint is not None:
            engine.grammars.compile(constraint, "format")
        turns = ([OllamaMessage(role="system", content=req.system)] if req.system else []) + \
            [OllamaMessage(role="user", content=req.prompt, images=req.images)]
        parsed = engine.parse(Request(self.messages(turns, engine), sampling(req, engine, constraint), cache_salt=salt,
                                      template_kwargs=switch), deadline)
        return Spec(req, engine.model_name, False), parsed

    def messages(self, messages: list[OllamaMessage], engine: Engine) -> list[dict]:
        """Ollama messages -> engine messages: base64 images decoded and checked; a tool
        message must follow an assistant message with tool calls (and name one of them)."""
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        images = sum(len(m.images or []) for m in messages)
        if images > engine.options.max_images:
            raise bad_request(f"too many images: {images}; this server takes at most {engine.options.max_images} "
                              "per request", "messages")
        out, called = [], None
        for i, m in enumerate(messages):
            if m.role == "system" and i > 0:
                raise bad_request("a system message may only come first", f"messages[{i}].role")
            parts: list[dict] = []
            for j, data in enumerate(m.images or []):
                if m.role != "user":
                    raise bad_request("images are only accepted in user messages", f"messages[{i}].images")
                try:
                    parts.append({"type": "image", "image": load_image_bytes(
                        f"data:image/*;base64,{data.partition(',')[2] if data.startswith('data:') else data}",
                        self.state.settings.images)})
                except ImageError as exc:
                    raise bad_request(str(exc), f"messages[{i}].images[{j}]") from None
            parts.append({"type": "text", "text": m.content})
            entry = {"role": m.role, "content": parts}
            if m.role == "tool":
                if called is None or (m.tool_name is not None and m.tool_name not in called):
                    raise bad_request("a tool message must answer a tool call of the assistant message before it",
                                      f"messages[{i}]")
            elif m.tool_calls:
                if m.role != "assistant":
                    raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
                entry["tool_calls"] = [call_entry(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(m.tool_calls)]
                called = {c["function"]["name"] for c in entry["tool_calls"]}
            else:
                called = None
            out.append(entry)
        return out


def think_switch(req: Common, engine: Engine) -> dict:
    """The template variables `think` sets. A template with a thinking switch (Qwen3.5) turns
    thinking on or off as `think` says; otherwise true needs a Thinking model and false only
    hides a Thinking model's reasoning (it cannot answer without it)."""
    if req.think not in (None, False, True):
        raise bad_request("think must be true or false", "think")
    if req.think is None:
        return {}
    if engine.thinking_switch:
        return {"enable_thinking": req.think}
    if req.think is True and not engine.thinks():
        raise bad_request(f'"{engine.model_name}" does not support thinking', "think")
    return {}


def tool_from(tool: dict, i: int):
    function = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request('a tool must be {"type": "function", "function": {"name", "parameters"}}', f"tools[{i}]")
    return check_tool(function.get("name"), function.get("description"), function.get("parameters"),
                      f"tools[{i}].function")


def call_entry(call: OllamaCall, param: str) -> dict:
    name, arguments = call.function.get("name"), call.function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad_request("a tool call needs a function name and arguments as an object", param)
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def format_constraint(fmt: Any) -> Constraint | None:
    """format: "" or absent (free text), "json" (any JSON object) or a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return Constraint.json(None)
    if isinstance(fmt, dict):
        return Constraint.json(fmt)
    raise bad_request('format must be "json" or a JSON schema object', "format")


def sampling(req: Common, engine: Engine, constraint: Constraint | None):
    o = req.options
    limit = o.num_predict
    if limit is not None and limit < 0:
        limit = engine.options.max_context // 2  # "until the context is full": the budget check bounds it
    elif limit == 0:
        raise bad_request("num_predict must not be 0", "options.num_predict")
    return engine.sampling_defaults(
        max_new_tokens=limit, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, seed=o.seed,
        stop=tuple(o.stop) if o.stop else None, repetition_penalty=o.repeat_penalty,
        presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty, constraint=constraint)


# -- answers -----------------------------------------------------------------------------------


def answer_parts(done: Done, tools: bool) -> tuple[str, list[dict]]:
    """(text, Ollama tool calls) of a whole answer: only whole calls whose arguments are an
    object count, any other `<tool_call>` block (cut by num_predict, not JSON) stays text."""
    if not tools:
        return done.text, []
    text, calls = parse_answer(done.text, whole=True)
    return (text if not calls else text.strip()), [ollama_call(c) for c in calls]


def ollama_call(call) -> dict:
    """A call read with `whole=True` (its arguments parse as an object) in Ollama's shape."""
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def line(spec: Spec, text: str, calls: list[dict] | None = None, thinking: str = "", **extra) -> dict:
    body: dict[str, Any] = {"model": spec.model, "created_at": now()}
    thinking = {"thinking": thinking} if thinking and spec.show_thinking else {}
    if spec.chat:
        message = {"role": "assistant", "content": text, **thinking}
        if calls:
            message["tool_calls"] = calls
        body["message"] = message
    else:
        body.update(response=text, **thinking)
    return {**body, "done": False, **extra}


def final_line(spec: Spec, done: Done, text: str, calls: list[dict] | None = None, thinking: str = "") -> dict:
    """The last object: done, why, and Ollama's counts and durations (nanoseconds)."""
    t, u = done.timings, done.usage
    decode_ns = int(sum(t.decode_ms) * 1e6)
    return line(spec, text, calls, thinking, done=True, done_reason=done.finish_reason,
                total_duration=int(t.ttft_ms * 1e6) + decode_ns, load_duration=0,
                prompt_eval_count=u.prompt_tokens, prompt_eval_duration=int(t.ttft_ms * 1e6),
                eval_count=u.completion_tokens, eval_duration=decode_ns)


async def ndjson(events: AsyncIterator[Delta | Done], spec: Spec) -> AsyncIterator[str]:
    """One JSON object per line: text pieces, a tool call as soon as it is whole (a block that
    is no whole call is text), then the final object. An error after the headers went out is
    a line {"error": ...}, as Ollama sends it."""
    parser = ToolCallStream(whole=True) if spec.tools else None
    sent_calls = 0
    try:
        async for event in events:
            pieces, thinking = [], event.reasoning if isinstance(event, Delta) else ""
            if isinstance(event, Delta):
                pieces = parser.feed(event.text) if parser else [TextPiece(event.text)]
            elif parser:
                pieces = parser.finish()
            text = "".join(p.text for p in pieces if isinstance(p, TextPiece))
            calls = [ollama_call(c) for c in parser.calls[sent_calls:]] if parser else []
            sent_calls += len(calls)
            if isinstance(event, Done):
                yield json.dumps(final_line(spec, event, text, calls), ensure_ascii=False) + "\n"
                return
            if text or calls or (thinking and spec.show_thinking):
                yield json.dumps(line(spec, text, calls, thinking), ensure_ascii=False) + "\n"
    except APIError as exc:
        yield json.dumps({"error": exc.message}) + "\n"


def version() -> dict:
    return {"version": OLLAMA_VERSION}

