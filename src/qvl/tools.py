"""Function tools: checked definitions, the grammar that makes an answer a call (or calls),
and the parser that turns Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks into calls, whole or as the text streams in. Every front door (chat completions,
responses, Ollama) uses these; each only maps the events to its own wire format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from qvl.grammar import Constraint, with_layout
from qvl.requests import RequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
ANY_OBJECT = {"type": "object"}
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_ARGS_TAIL = re.compile(r"\s*\}?\s*$")  # what may follow the arguments inside a block (held back)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # JSON schema of the arguments object

    def template_entry(self) -> dict:
        """As the chat template lists it (OpenAI's chat-completions shape)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


def check_tool(name, description, parameters, param: str) -> Tool:
    """A tool from its parts, or RequestError naming `param`."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError("a function name must be 1-64 letters, digits, '_', '.' or '-'", f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise RequestError("a function description must be a string", f"{param}.description")
    if parameters is None:
        parameters = ANY_OBJECT
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise RequestError("a function's parameters must be a JSON schema of an object", f"{param}.parameters")
    return Tool(name, description, parameters)


def check_unique(tools: list[Tool], param: str) -> list[Tool]:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"two tools are named '{twice}'", param)
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """auto: the model decides; none: no call (tools are not shown to it); required: at least
    one call; `name` set: exactly a call of that function."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The answer must be a call (required, or a named function)."""
        return self.mode in ("required", "function")


def answer_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool, answer: Constraint | None,
                      tokenizer, param: str = "tool_choice") -> Constraint | None:
    """What the answer must match, from the tools and the answer's own format (a JSON schema,
    regex or grammar; None: free text). auto: calls or the answer (free text is not
    enforced, so nothing is; a JSON answer becomes "that JSON, or calls"); required: one or
    more (parallel) `<tool_call>` blocks whose JSON names a function and matches its
    parameters schema; a named function: exactly one call of it. Raises RequestError for
    combinations no grammar can honour."""
    if choice.mode == "none" or not tools:
        return answer
    if choice.mode == "auto" and answer is None:
        return None
    if choice.forced and answer is not None:
        raise RequestError("a forced tool call cannot also follow a response format: drop one of them", param)
    if answer is not None and answer.kind != "json_schema":
        raise RequestError("with tools, the answer format can only be a JSON schema", param)
    chosen = [t for t in tools if choice.name in (None, t.name)]
    bodies = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
               "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    body = with_layout(bodies[0] if len(bodies) == 1 else {"anyOf": bodies})
    open_id, close_id = tokenizer.token_id(CALL_OPEN), tokenizer.token_id(CALL_CLOSE)
    rules = ["start: answer | calls" if answer is not None else "start: calls",
             'calls: call ("\\n" call)*' if parallel and choice.name is None else "calls: call",
             f'call: <[{open_id}]> "\\n" body "\\n" <[{close_id}]>',
             f"body: %json {json.dumps(body, ensure_ascii=False)}"]
    if answer is not None:
        rules.append(f"answer: %json {answer.source}")
    return Constraint("lark", "\n".join(rules))


# -- parsing ---------------------------------------------------------------------------------


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it


@dataclass
class TextPiece:
    text: str


@dataclass
class CallStart:
    index: int  # which call of the answer (0, 1, ...)
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


Event = TextPiece | CallStart | CallArguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class ToolCallStream:
    """Answer text in, events out: plain text as TextPiece, each `<tool_call>` block as a
    CallStart (once its name is known) and CallArguments pieces. Text that could still turn
    into a block's opening is held back until it cannot. A block that is not a valid call
    (an unconstrained model may write anything) is given back as text if nothing of it was
    sent as a call yet."""

    pending: str = ""  # text not yet classified
    block: str | None = None  # inside a block: its text so far
    current: CallStart | None = None
    args_from: int = 0  # where the current call's arguments start in `block`
    sent: int = 0  # characters of the current call's arguments already sent
    after_call: bool = False  # a block just closed: a newline next is the separator between calls
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self.pending += text
        if self.after_call and self.pending:
            self.pending, self.after_call = self.pending.removeprefix("\n"), False
        while self.pending:
            if self.block is None:
                at = self.pending.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.pending, CALL_OPEN)
                    out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                    if out:
                        events.append(TextPiece(out))
                    break
                if at:
                    events.append(TextPiece(self.pending[:at]))
                self.block, self.pending = "", self.pending[at + len(CALL_OPEN):]
            else:
                at = self.pending.find(CALL_CLOSE)
                if at < 0:
                    keep = _partial_suffix(self.pending, CALL_CLOSE)
                    self.block += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    events += self._progress()
                    break
                self.block += self.pending[:at]
                self.pending = self.pending[at + len(CALL_CLOSE):]
                events += self._close()
                self.after_call = not self.pending
                self.pending = self.pending.removeprefix("\n")  # the template's separator between calls
        return events

    def finish(self) -> list[Event]:
        """The answer ended: what was held back, and a block left open closed as it stands."""
        events: list[Event] = []
        if self.block is not None:
            self.block += self.pending
            self.pending = ""
            events += self._close()
        if self.pending:
            events.append(TextPiece(self.pending))
            self.pending = ""
        return events

    def _progress(self) -> list[Event]:
        events: list[Event] = []
        if self.current is None:
            head = _CALL_HEAD.match(self.block)
            if head is None:
                return events
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return events
            self.current = CallStart(len(self.calls), new_call_id(), name)
            self.args_from, self.sent = head.end(), 0
            events.append(self.current)
        arguments = self.block[self.args_from:]
        safe = len(arguments) - len(_ARGS_TAIL.search(arguments).group(0))
        if safe > self.sent:
            events.append(CallArguments(self.current.index, arguments[self.sent: safe]))
            self.sent = safe
        return events

    def _close(self) -> list[Event]:
        """The block ended: the call it holds (its last arguments piece), or its text back."""
        events = self._progress()
        block, start, self.block = self.block, self.current, None
        self.current = None
        call = _parse_call(block)
        if call is None or (start is not None and not call[1].startswith(block[self.args_from:][: self.sent])):
            if start is None:
                return events + [TextPiece(f"{CALL_OPEN}{block}{CALL_CLOSE}")]
            call = (start.name, block[self.args_from:][: self.sent])  # sent as a call already: keep it
        name, arguments = call
        if start is None:
            start = CallStart(len(self.calls), new_call_id(), name)
            events.append(start)
            self.sent = 0
        if len(arguments) > self.sent:
            events.append(CallArguments(start.index, arguments[self.sent:]))
        self.calls.append(ToolCall(start.id, start.name, arguments))
        return events


def _parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a block `{"name": ..., "arguments": {...}}`, or None."""
    head = _CALL_HEAD.match(block)
    if head is None:
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
        arguments, end = json.JSONDecoder().raw_decode(block, head.end())
    except ValueError:
        return None
    if not isinstance(arguments, dict) or not re.fullmatch(r"\s*\}\s*", block[end:]):
        return None
    return name, block[head.end(): end]


def parse_answer(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (its text outside tool-call blocks, the calls)."""
    stream = ToolCallStream()
    events = stream.feed(text) + stream.finish()
    return "".join(e.text for e in events if isinstance(e, TextPiece)), stream.calls
