"""POST /v1/chat/completions: an OpenAI request -> an engine Request -> a `chat.completion`,
or Server-Sent Events of `chat.completion.chunk` objects exactly as OpenAI sends them, with
response formats (JSON schemas, enforced), tools and tool calls.

Everything that can reject a request (JSON, types, images, the context budget, a schema)
runs before the request is queued, so bad input gets a 400 even when `stream` is true."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from qvl.deadline import Deadline
from qvl.engine import Engine, ParsedRequest, Request, RequestError
from qvl.grammar import Constraint
from qvl.processing.image import ImageError
from qvl.grounding import grounding
from qvl.requests import VIDEO_PARAMS
from qvl.sampling import SamplingParams
from qvl.server.errors import APIError, bad_request
from qvl.server.images import load_image_bytes, load_video_bytes
from qvl.server.schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                Choice, ChunkChoice, Message, NamedToolChoice, StructuredOutputs, ToolDefinition,
                                Usage)
from qvl.server.settings import ImagePolicy
from qvl.server.state import ServerState
from qvl.server.submit import EventStream, Submitter
from qvl.stream import Delta, Done, TokenLogprob
from qvl.tools import (CallArguments, CallStart, TextPiece, Tool, ToolCallStream, ToolChoice, answer_constraint,
                       check_tool, check_unique, parse_answer)


@dataclass(frozen=True)
class Meta:
    """What every chunk of one completion repeats."""

    id: str
    created: int
    model: str
    tokenizer: object  # token ids -> text and bytes, for logprobs
    tools: bool = False  # tools were offered: answers are parsed for tool calls
    shown_size: tuple[int, int] | None = None  # (width, height) of the last image: grounding answers' pixels


class ChatCompletions:
    def __init__(self, state: ServerState, submit: Submitter):
        self.state, self.submit = state, submit

    async def __call__(self, http: HTTPRequest) -> Response:
        sub = await self.submit(http, self.read, self.prepare)
        req: ChatCompletionRequest = sub.spec
        meta = Meta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), sub.engine.model_name, sub.engine.tokenizer,
                    tools_offered(req), sub.parsed.last_image_size)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(sse(sub.events, meta, include_usage, req.n), sub.on_close)
        return JSONResponse(completion(await sub.finals(http), meta).model_dump())

    @staticmethod
    def read(body: bytes) -> tuple[ChatCompletionRequest, bool]:
        """The validated body, and whether it carries images or videos."""
        req = ChatCompletionRequest.model_validate_json(body)
        return req, any(part.type != "text" for m in req.messages for part in m.content)

    def prepare(self, req: ChatCompletionRequest, engine: Engine, deadline: Deadline,
                salt: str) -> tuple[ChatCompletionRequest, ParsedRequest]:
        """Check, fetch and decode images, tokenize, check the budget and the grammar (in a
        thread, within `deadline`)."""
        if name := req.unsupported():
            raise bad_request(f"'{name}' is not supported by qvl", name, "unsupported_parameter")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        messages = engine_messages(req.messages, self.state.settings.images, engine.options.max_images,
                                   engine.options.max_videos)
        tools = check_tools(req.tools)
        named = isinstance(req.tool_choice, NamedToolChoice)
        choice = tool_choice(None if named else req.tool_choice, req.tool_choice.function.name if named else None, tools)
        constraint = answer_constraint(tools, choice, req.parallel_tool_calls, answer_format(req), engine.tokenizer)
        if constraint is not None:  # named after the field that asked for it
            engine.grammars.compile(constraint, "tool_choice" if tools and choice.forced else
                                    "structured_outputs" if req.structured_outputs else "response_format")
        shown = [t.template_entry() for t in tools] if choice.mode != "none" else None
        switches = {} if req.chat_template_kwargs is None else req.chat_template_kwargs  # the engine checks them
        try:
            parsed = engine.parse(Request(messages, sampling(req, engine, constraint), image_tokens(req, engine), shown,
                                          video_overrides(req), salt, template_kwargs=switches), deadline)
        except RequestError as exc:
            if exc.code in ("invalid_image", "invalid_video") and exc.param and exc.param.endswith("]"):
                exc.param += ".image_url.url" if exc.code == "invalid_image" else ".video_url.url"  # the part -> its url
            raise
        return req, parsed


def engine_messages(messages: list[Message], policy: ImagePolicy, max_images: int, max_videos: int = 0) -> list[dict]:
    """OpenAI messages -> engine messages: image_url and video_url parts become bytes,
    assistant tool calls keep their arguments as objects (the template writes them out), and
    each tool message must answer a call of the assistant message before it."""
    for kind, most in (("image", max_images), ("video", max_videos)):
        count = sum(part.type == f"{kind}_url" for m in messages for part in m.content)
        if count > most:
            raise bad_request(f"too many {kind}s: {count}; this server takes at most {most} per request",
                              "messages", f"too_many_{kind}s")
    out, open_calls = [], set()
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if role == "system" and i > 0:
            raise bad_request("a system message may only come first", f"messages[{i}].role")
        parts = []
        for j, part in enumerate(message.content):
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            elif role != "user":
                raise bad_request("images and videos are only accepted in user messages", f"messages[{i}].content[{j}]")
            elif part.type == "video_url":
                try:
                    parts.append({"type": "video", "video": load_video_bytes(part.video_url.url, policy)})
                except ImageError as exc:
                    raise bad_request(str(exc), f"messages[{i}].content[{j}].video_url.url", "invalid_video") from None
            else:
                param = f"messages[{i}].content[{j}].image_url.url"
                try:
                    image = {"type": "image", "image": load_image_bytes(part.image_url.url, policy)}
                    parts.append({**image, "pages": part.image_url.pages} if part.image_url.pages else image)
                except ImageError as exc:
                    raise bad_request(str(exc), param, "invalid_image") from None
        entry = {"role": role, "content": parts}
        if message.tool_calls:
            if role != "assistant":
                raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            entry["tool_calls"] = [{"type": "function", "function": {
                "name": call.function.name,
                "arguments": call_arguments(call.function.arguments, f"messages[{i}].tool_calls[{k}].function.arguments")}}
                for k, call in enumerate(message.tool_calls)]
            open_calls = {call.id for call in message.tool_calls}
        elif role == "tool":
            if message.tool_call_id not in open_calls:
                raise bad_request(f"this tool message answers '{message.tool_call_id}', which is no call of the "
                                  "assistant message before it", f"messages[{i}].tool_call_id", "unknown_tool_call")
            open_calls.discard(message.tool_call_id)
        else:
            open_calls = set()
        out.append(entry)
    return out


def call_arguments(text: str, param: str) -> dict:
    try:
        arguments = json.loads(text)
    except ValueError:
        raise bad_request("a tool call's arguments must be a JSON object", param) from None
    if not isinstance(arguments, dict):
        raise bad_request("a tool call's arguments must be a JSON object", param)
    return arguments


def check_tools(definitions: list[ToolDefinition] | None, param: str = "tools") -> list[Tool]:
    tools = [check_tool(d.function.name, d.function.description, d.function.parameters, f"{param}[{i}].function")
             for i, d in enumerate(definitions or [])]
    return check_unique(tools, param)


def tool_choice(mode: str | None, name: str | None, tools: list[Tool], param: str = "tool_choice") -> ToolChoice:
    """A tool_choice (auto, none, required; default auto) or a named function -> ToolChoice;
    a named function must be one of the tools."""
    if name is None:
        mode = mode or "auto"
        if mode == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", param)
        return ToolChoice(mode)
    if name not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names '{name}', which is not among the tools", param)
    return ToolChoice("function", name)


def answer_format(req: ChatCompletionRequest) -> Constraint | None:
    """response_format or structured_outputs (not both) as a constraint."""
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    if extra is not None:
        return structured_constraint(extra)
    return format_constraint(fmt.type, fmt.json_schema.schema_ if fmt.json_schema else None) if fmt else None


def format_constraint(kind: str, schema: dict | None) -> Constraint | None:
    """text / json_object / json_schema (as both OpenAI APIs name them) -> a constraint."""
    if kind == "text":
        return None
    return Constraint.json(schema if kind == "json_schema" else None)


def structured_constraint(extra: StructuredOutputs) -> Constraint:
    if extra.json_ is not None:
        return Constraint.json(extra.json_)
    if extra.choice is not None:
        return Constraint("regex", "|".join(re.escape(c) for c in extra.choice))
    return Constraint("regex", extra.regex) if extra.regex is not None else Constraint("lark", extra.grammar)


def tools_offered(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def sampling(req: ChatCompletionRequest, engine: Engine, constraint: Constraint | None = None) -> SamplingParams:
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
        logit_bias=bias, logprobs=(req.top_logprobs or 0) if req.logprobs else None, n=req.n,
        constraint=constraint, reasoning_budget=req.reasoning_budget)


def video_overrides(req: ChatCompletionRequest) -> dict | None:
    """fps, max_frames, max_video_tokens -> the engine's video settings for this request
    (checked against the server's caps when the request is parsed)."""
    over = {key: getattr(req, field) for key, field in VIDEO_PARAMS.items()}
    return {k: v for k, v in over.items() if v is not None} or None


def image_tokens(req: ChatCompletionRequest, engine: Engine) -> int | None:
    """max_pixels -> a per-image token budget; it may raise or lower the server's default, up
    to the engine's cap (checked when the request is parsed)."""
    if req.max_pixels is None:
        return None
    return max(1, req.max_pixels // engine.image_cfg.factor**2)


# -- answers -----------------------------------------------------------------------------------


def usage(dones: list[Done]) -> Usage:
    """One prompt (its cached tokens as the first answer reused them), every answer's tokens
    (reasoning included, and counted apart)."""
    prompt, completion_tokens = dones[0].usage.prompt_tokens, sum(d.usage.completion_tokens for d in dones)
    details = ({"reasoning_tokens": sum(d.usage.reasoning_tokens for d in dones)}
               if any(d.reasoning is not None for d in dones) else None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens,
                 prompt_tokens_details={"cached_tokens": dones[0].timings.reused_tokens},
                 completion_tokens_details=details)


def extras(done: Done, meta: Meta) -> dict:
    """qvl's own numbers, under an extra "qvl" key; with boxes and points when the answer
    holds grounding JSON, in the pixels of the request's last image (image_size)."""
    out = {"timings": done.to_dict()["timings"], "image_tokens": done.usage.image_tokens,
           "video_tokens": done.usage.video_tokens}
    found = grounding(done.text, meta.shown_size)
    if found["boxes"] or found["points"]:
        out.update(found, image_size=list(meta.shown_size) if meta.shown_size else None)
    return out


def logprobs_body(logprobs: list[TokenLogprob] | None, tokenizer) -> dict | None:
    """OpenAI's logprobs object: each token as text and bytes, its logprob, the alternatives."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                        for lp in logprobs], "refusal": None}


def assistant_message(done: Done, tools: bool) -> tuple[AssistantMessage, str]:
    """The answer as a message (tool-call blocks as tool_calls when tools were offered) and
    its finish_reason."""
    text, calls = parse_answer(done.text) if tools else (done.text, [])
    if not calls:
        return AssistantMessage(content=done.text, reasoning_content=done.reasoning), done.finish_reason
    return AssistantMessage(content=text.strip() or None, reasoning_content=done.reasoning, tool_calls=[
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]), \
        "tool_calls" if done.finish_reason == "stop" else done.finish_reason


def completion(dones: list[Done], meta: Meta) -> ChatCompletion:
    choices = []
    for d in dones:
        message, finish_reason = assistant_message(d, meta.tools)
        choices.append(Choice(index=d.index, message=message, finish_reason=finish_reason,
                              logprobs=logprobs_body(d.logprobs, meta.tokenizer)))
    return ChatCompletion(id=meta.id, created=meta.created, model=meta.model, usage=usage(dones),
                          qvl=extras(dones[0], meta),
                          choices=choices)


def chunk(meta: Meta, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None, index: int = 0,
          **extra) -> str:
    choices = ([ChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)]
               if delta is not None else [])
    body = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices, **extra)
    return f"data: {body.model_dump_json()}\n\n"


def tool_deltas(events: list) -> list[dict]:
    """ToolCallStream events -> chat-completion deltas, as OpenAI streams a call: id, type and
    name first, then pieces of the arguments."""
    out = []
    for e in events:
        if isinstance(e, TextPiece):
            out.append({"content": e.text})
        elif isinstance(e, CallStart):
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, CallArguments):
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out


async def sse(events: AsyncIterator[Delta | Done], meta: Meta, include_usage: bool,
              n: int = 1) -> AsyncIterator[str]:
    """Per answer (index 0..n-1): a role delta, content (or tool-call) deltas, its
    finish_reason chunk; then [usage chunk], [DONE]. An error after the headers went out
    (time limit, shutdown) is sent as OpenAI does: data: {"error"}."""
    for index in range(n):
        yield chunk(meta, {"role": "assistant", "content": ""}, index=index)
    dones = []
    calls = {index: ToolCallStream() for index in range(n)} if meta.tools else None
    held: dict[int, list] = {index: [] for index in range(n)}  # logprobs not yet sent, per answer
    try:
        async for event in events:
            if isinstance(event, Delta):
                if event.reasoning:
                    yield chunk(meta, {"reasoning_content": event.reasoning}, index=event.index)
                if not event.text and event.reasoning:
                    if event.logprobs is not None:
                        held[event.index] += event.logprobs
                    continue
                if event.logprobs is not None:  # text held back (a tool call may start) keeps its logprobs
                    held[event.index] += event.logprobs
                deltas = tool_deltas(calls[event.index].feed(event.text)) if calls else [{"content": event.text}]
                for delta in deltas:
                    logprobs = logprobs_body(held[event.index], meta.tokenizer) if held[event.index] else None
                    held[event.index] = []
                    yield chunk(meta, delta, logprobs=logprobs, index=event.index)
                continue
            dones.append(event)
            finish_reason = event.finish_reason
            if calls:
                for delta in tool_deltas(calls[event.index].finish()):
                    yield chunk(meta, delta, index=event.index)
                if calls[event.index].calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            yield chunk(meta, {}, finish_reason, index=event.index, qvl=extras(event, meta))
        if include_usage:
            yield chunk(meta, None, usage=usage(dones))
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"
