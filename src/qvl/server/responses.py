"""POST /v1/responses, stateless: OpenAI's Responses API over the same engine path as chat
completions. Input items (messages with input_text / input_image parts, function_call and
function_call_output items) become a conversation; `instructions` its system message;
text.format a JSON schema the answer must follow; function tools as in chat. The answer is
a `response` object, or its streaming events (response.created ... response.completed).
Nothing is stored: previous_response_id and background are refused."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, model_validator

from qvl.deadline import Deadline
from qvl.engine import Engine, ParsedRequest, Request
from qvl.processing.image import ImageError
from qvl.server.errors import APIError, bad_request
from qvl.server.images import load_image_bytes
from qvl.server.openai import call_arguments, format_constraint, tool_choice
from qvl.server.schemas import MAX_MESSAGES, MAX_PARTS, CacheSalt, Seed, _Strict
from qvl.server.state import ServerState
from qvl.server.submit import EventStream, Submitter
from qvl.stream import Delta, Done
from qvl.tools import (CallArguments, CallStart, TextPiece, ToolCallStream, answer_constraint, check_tool, check_unique,
                       parse_answer)


class InputPart(_Strict):
    type: Literal["input_text", "output_text", "input_image", "input_file", "refusal"]
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # ignored: the pixel budget is max_pixels


class InputItem(_Strict):
    """A message (type "message" or none), a function_call or a function_call_output."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = Field(None, max_length=MAX_PARTS)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None


class FormatSpec(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> FormatSpec:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a format of type 'json_schema' needs a 'schema'")
        return self


class TextConfig(_Strict):
    format: FormatSpec = FormatSpec()


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # `summary` is not read: the reasoning itself is returned, never a summary of it

    def template_kwargs(self) -> dict:
        """The chat template's thinking switch: none and minimal turn it off, the others on; no
        effort keeps the template's default. A template without the switch ignores it."""
        return {} if self.effort is None else {"enable_thinking": self.effort not in ("none", "minimal")}


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem] = Field(min_length=1, max_length=MAX_MESSAGES)
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig = TextConfig()
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None  # nothing is stored whatever it says (the answer says store: false)
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    # qvl extras (as in chat completions)
    seed: Seed = None
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    max_pixels: int | None = Field(None, ge=1)
    reasoning: ReasoningConfig = ReasoningConfig()
    reasoning_budget: int | None = Field(None, ge=0)
    cache_salt: CacheSalt = None


@dataclass
class Spec:
    req: ResponsesRequest
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    model: str = ""
    tools: bool = False  # tools were offered: answers are parsed for tool calls


class Responses:
    def __init__(self, state: ServerState, submit: Submitter):
        self.state, self.submit = state, submit

    async def __call__(self, http: HTTPRequest) -> Response:
        sub = await self.submit(http, self.read, self.prepare)
        spec: Spec = sub.spec
        if spec.req.stream:
            return EventStream(stream_events(sub.events, spec), sub.on_close)
        done = (await sub.finals(http))[0]
        return JSONResponse(response_object(spec, done, output_items(done, spec.tools)))

    @staticmethod
    def read(body: bytes) -> tuple[ResponsesRequest, bool]:
        """The validated body, and whether it carries images."""
        req = ResponsesRequest.model_validate_json(body)
        items = [] if isinstance(req.input, str) else req.input
        parts = [part for it in items if isinstance(it.content, list) for part in it.content]
        return req, any(part.type == "input_image" for part in parts)

    def prepare(self, req: ResponsesRequest, engine: Engine, deadline: Deadline,
                salt: str) -> tuple[Spec, ParsedRequest]:
        if req.previous_response_id is not None:
            raise bad_request("qvl keeps no responses: send the whole conversation in 'input' instead of "
                              "previous_response_id", "previous_response_id", "unsupported_parameter")
        if req.background:
            raise bad_request("background responses are not supported by qvl", "background", "unsupported_parameter")
        tools = check_unique([check_tool(t.name, t.description, t.parameters, f"tools[{i}]")
                              for i, t in enumerate(req.tools or [])], "tools")
        named = isinstance(req.tool_choice, NamedFunctionChoice)
        choice = tool_choice(None if named else req.tool_choice, req.tool_choice.name if named else None, tools)
        fmt = req.text.format
        constraint = answer_constraint(tools, choice, req.parallel_tool_calls,
                                       format_constraint(fmt.type, fmt.schema_), engine.tokenizer)
        if constraint is not None:
            engine.grammars.compile(constraint, "tool_choice" if tools and choice.forced else "text.format")
        messages = conversation(req, self.state.settings.images, engine.options.max_images)
        sampling = engine.sampling_defaults(
            max_new_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, constraint=constraint,
            reasoning_budget=req.reasoning_budget)
        budget = max(1, req.max_pixels // engine.image_cfg.factor**2) if req.max_pixels else None
        shown = [t.template_entry() for t in tools] if choice.mode != "none" else None
        parsed = engine.parse(Request(messages, sampling, budget, shown, cache_salt=salt,
                                      template_kwargs=req.reasoning.template_kwargs()), deadline)
        return Spec(req, model=engine.model_name, tools=bool(tools) and choice.mode != "none"), parsed


def conversation(req: ResponsesRequest, policy, max_images: int) -> list[dict]:
    """Input items -> engine messages: instructions first (as the system message), function
    calls folded into the assistant turn they belong to, their outputs as tool messages."""
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    count = sum(isinstance(it.content, list) and sum(p.type == "input_image" for p in it.content) for it in items)
    if count > max_images:
        raise bad_request(f"too many images: {count}; this server takes at most {max_images} per request",
                          "input", "too_many_images")
    out: list[dict] = [{"role": "system", "content": [{"type": "text", "text": req.instructions}]}] \
        if req.instructions else []
    open_calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "reasoning":
            continue  # a reasoning model's notes: not part of the prompt
        if item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise bad_request("a function_call item needs call_id, name and arguments", where)
            call = {"type": "function", "function": {
                "name": item.name, "arguments": call_arguments(item.arguments, f"{where}.arguments")}}
            if not (out and out[-1]["role"] == "assistant"):  # calls join the assistant turn before them
                out.append({"role": "assistant", "content": []})
                open_calls = set()
            out[-1].setdefault("tool_calls", []).append(call)
            open_calls.add(item.call_id)
            continue
        if item.type == "function_call_output":
            if item.call_id not in open_calls:
                raise bad_request(f"this output answers '{item.call_id}', which is no function_call before it",
                                  f"{where}.call_id", "unknown_tool_call")
            open_calls.discard(item.call_id)
            out.append({"role": "tool", "content": [{"type": "text", "text": item.output or ""}]})
            continue
        if item.role is None:
            raise bad_request("a message item needs a role", f"{where}.role")
        role = "system" if item.role == "developer" else item.role
        if role == "system" and out:
            raise bad_request("a system message may only come first (instructions count as one)", f"{where}.role")
        out.append({"role": role, "content": message_parts(item, role, policy, where)})
        open_calls = set()
    return out


def message_parts(item: InputItem, role: str, policy, where: str) -> list[dict]:
    if item.content is None or isinstance(item.content, str):
        return [{"type": "text", "text": item.content or ""}]
    parts = []
    for j, part in enumerate(item.content):
        param = f"{where}.content[{j}]"
        if part.type in ("input_text", "output_text", "refusal"):
            parts.append({"type": "text", "text": part.text or ""})
        elif part.type == "input_file" or part.image_url is None:
            raise bad_request("qvl takes images as image_url (a data: URI or, if allowed, a URL); files and "
                              "file_id are not supported", param, "unsupported_parameter")
        elif role != "user":
            raise bad_request("images are only accepted in user messages", param)
        else:
            try:
                parts.append({"type": "image", "image": load_image_bytes(part.image_url, policy)})
            except ImageError as exc:
                raise bad_request(str(exc), f"{param}.image_url", "invalid_image") from None
    return parts


# -- answers -----------------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def new_item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def output_items(done: Done, tools: bool) -> list[dict]:
    """The answer as output items: a Thinking model's reasoning, a message with its text (if
    any) and function calls."""
    reasoning = [reasoning_item(new_item_id("rs"), done.reasoning)] if done.reasoning is not None else []
    return reasoning + answer_items(done, tools)


def answer_items(done: Done, tools: bool) -> list[dict]:
    if not tools:
        return [message_item(new_item_id("msg"), done.text)]
    text, calls = parse_answer(done.text)
    items = [message_item(new_item_id("msg"), text)] if text.strip() or not calls else []
    return items + [call_item(new_item_id("fc"), c.id, c.name, c.arguments) for c in calls]


def response_object(spec: Spec, done: Done | None, output: list[dict]) -> dict:
    """The `response` object; done None: still in progress."""
    req = spec.req
    status, incomplete, usage = "in_progress", None, None
    if done is not None:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        u = done.usage
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": done.timings.reused_tokens},
                 "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                 "total_tokens": u.total_tokens}
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True)
    tool_choice_out: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice) \
        else (req.tool_choice or "auto")
    return {"id": spec.id, "object": "response", "created_at": spec.created, "status": status, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions, "model": spec.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p, "tool_choice": tool_choice_out,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt}, "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
            "store": False, "metadata": req.metadata or {}, "truncation": "disabled", "usage": usage,
            **({"qvl": {"timings": done.to_dict()["timings"], "image_tokens": done.usage.image_tokens}}
               if done is not None else {})}


class EventWriter:
    """Responses streaming events with their sequence numbers, as SSE."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream_events(events: AsyncIterator[Delta | Done], spec: Spec) -> AsyncIterator[str]:
    """response.created, in_progress; per output item: added, its text or argument deltas, done;
    response.completed (or incomplete) with the whole response. An error after the headers
    went out is sent as an `error` event, then response.failed."""
    emit, output = EventWriter(), []
    yield emit("response.created", response=response_object(spec, None, []))
    yield emit("response.in_progress", response=response_object(spec, None, []))
    parser = ToolCallStream() if spec.tools else None
    message: dict | None = None  # the open message item: {"id", "index", "parts"} (its text in pieces)
    call: dict | None = None  # the open function_call item: {"id", "index", "call_id", "name", "parts"}
    thought: dict | None = None  # the open reasoning item: {"id", "index", "parts"}

    def think(piece: str) -> list[str]:
        nonlocal thought
        out = []
        if thought is None:
            thought = {"id": new_item_id("rs"), "index": len(output), "parts": []}
            output.append(None)
            out.append(emit("response.output_item.added", output_index=thought["index"],
                            item=reasoning_item(thought["id"], "", "in_progress")))
        thought["parts"].append(piece)
        return out + [emit("response.reasoning_text.delta", item_id=thought["id"], output_index=thought["index"],
                           content_index=0, delta=piece)]

    def close_thought() -> list[str]:
        nonlocal thought
        t, thought = thought, None
        if t is None:
            return []
        item = reasoning_item(t["id"], "".join(t["parts"]))
        output[t["index"]] = item
        return [emit("response.reasoning_text.done", item_id=t["id"], output_index=t["index"], content_index=0,
                     text=item["content"][0]["text"]),
                emit("response.output_item.done", output_index=t["index"], item=item)]

    def open_message() -> list[str]:
        nonlocal message
        message = {"id": new_item_id("msg"), "index": len(output), "parts": []}
        output.append(None)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [emit("response.output_item.added", output_index=message["index"],
                     item=message_item(message["id"], "", "in_progress")),
                emit("response.content_part.added", item_id=message["id"], output_index=message["index"],
                     content_index=0, part=part)]

    def close_message() -> list[str]:
        nonlocal message
        m, message = message, None
        item = message_item(m["id"], "".join(m["parts"]))
        output[m["index"]] = item
        return [emit("response.output_text.done", item_id=m["id"], output_index=m["index"], content_index=0,
                     text=item["content"][0]["text"], logprobs=[]),
                emit("response.content_part.done", item_id=m["id"], output_index=m["index"], content_index=0,
                     part=item["content"][0]),
                emit("response.output_item.done", output_index=m["index"], item=item)]

    def close_call() -> list[str]:
        nonlocal call
        c, call = call, None
        item = call_item(c["id"], c["call_id"], c["name"], "".join(c["parts"]))
        output[c["index"]] = item
        return [emit("response.function_call_arguments.done", item_id=c["id"], output_index=c["index"],
                     name=c["name"], arguments=item["arguments"]),
                emit("response.output_item.done", output_index=c["index"], item=item)]

    def on(pieces: list) -> list[str]:
        nonlocal call
        out = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                if call is not None:
                    out += close_call()
                if message is None:
                    out += open_message()
                message["parts"].append(piece.text)
                out.append(emit("response.output_text.delta", item_id=message["id"], output_index=message["index"],
                                content_index=0, delta=piece.text, logprobs=[]))
            elif isinstance(piece, CallStart):
                out += close_message() if message is not None else []
                out += close_call() if call is not None else []
                call = {"id": new_item_id("fc"), "index": len(output), "call_id": piece.id, "name": piece.name,
                        "parts": []}
                output.append(None)
                out.append(emit("response.output_item.added", output_index=call["index"],
                                item=call_item(call["id"], piece.id, piece.name, "", "in_progress")))
            elif isinstance(piece, CallArguments):
                call["parts"].append(piece.text)
                out.append(emit("response.function_call_arguments.delta", item_id=call["id"],
                                output_index=call["index"], delta=piece.text))
        return out

    try:
        async for event in events:
            if isinstance(event, Delta):
                for line in think(event.reasoning) if event.reasoning else []:
                    yield line
                if not event.text:
                    continue
                for line in close_thought() + on(parser.feed(event.text) if parser else [TextPiece(event.text)]):
                    yield line
                continue
            for line in close_thought() + on(parser.finish() if parser else []):
                yield line
            if message is None and all(o is not None and o["type"] == "reasoning" for o in output):  # no answer yet:
                # an empty answer is still a message
                for line in open_message():
                    yield line
            for line in (close_message() if message is not None else []) + (close_call() if call is not None else []):
                yield line
            final = response_object(spec, event, output)
            yield emit("response.completed" if final["status"] == "completed" else "response.incomplete",
                       response=final)
            return
    except APIError as exc:
        yield emit("error", code=exc.code, message=exc.message, param=exc.param)
        failed = {**response_object(spec, None, [o for o in output if o]), "status": "failed",
                  "error": {"code": exc.code or "server_error", "message": exc.message}}
        yield emit("response.failed", response=failed)

