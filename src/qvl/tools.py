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
# Model output is read in one pass, each character looked at a bounded number of times however
# the text arrives (whole or a character at a time): no pattern that backtracks over the
# answer, no rescanning of what came before.

HEAD_MAX = 256  # characters: a block's head ({"name": "...", "arguments": ) must end within them
MAX_DEPTH = 100  # nesting of a call's arguments read as an object (Python's json recurses per level)
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_STRUCTURE = re.compile(r'["{}\[\]]')  # outside a string: what changes the nesting
_STRING_STOP = re.compile(r'["\\]')  # inside a string: its end, or an escape


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it (cut short if the answer was)


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


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """Length of the longest tail of `text[start:]` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _JsonExtent:
    """Follows a JSON object's text piece by piece, strings and brackets only (not its full
    syntax), to find where it closes and how deeply it nests; each character is read once."""

    def __init__(self):
        self.depth = self.deepest = 0
        self.in_string = self.escaped = self.closed = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the object (all, while it stays open)."""
        i = 0
        while i < len(text) and not self.closed:
            if self.escaped:
                self.escaped, i = False, i + 1
                continue
            found = (_STRING_STOP if self.in_string else _STRUCTURE).search(text, i)
            if found is None:
                return len(text)
            i, char = found.end(), found.group()
            if char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = not self.in_string
            elif char in "{[":
                self.depth += 1
                self.deepest = max(self.deepest, self.depth)
            else:
                self.depth -= 1
                self.closed = self.depth == 0
        return i


@dataclass
class _Block:
    """One `<tool_call>` block as its text arrives: its head read from its first HEAD_MAX
    characters, then its arguments object followed to its end."""

    text: list[str] = field(default_factory=list)  # all of it, in pieces
    head: str | None = ""  # its start while the head is awaited; None once it cannot come
    name: str | None = None  # read from the head
    start: CallStart | None = None  # sent when the head was read (streaming calls)
    extent: _JsonExtent = field(default_factory=_JsonExtent)
    arguments: list[str] = field(default_factory=list)
    rest: list[str] = field(default_factory=list)  # what follows the arguments object

    def read_head(self, piece: str) -> str | None:
        """With the next piece: the arguments' text in it once the head is read, else None."""
        text = self.head + piece
        head = _CALL_HEAD.match(text, 0, HEAD_MAX)
        if head is None:
            self.head = text if len(text) < HEAD_MAX else None  # None: past HEAD_MAX, it cannot come
            return None
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            self.head = None
            return None
        self.name, self.head = name, ""
        return text[head.end():]

    def grow(self, piece: str) -> str:
        """The arguments' text in `piece` (the rest goes after them)."""
        n = self.extent.feed(piece) if not self.extent.closed else 0
        if n < len(piece):
            self.rest.append(piece[n:])
        if n:
            self.arguments.append(piece[:n])
        return piece[:n]

    def arguments_object(self) -> dict | None:
        """The arguments as an object: whole, strict JSON, nested at most MAX_DEPTH deep, and
        followed only by the block's closing brace; else None."""
        if not self.extent.closed or self.extent.deepest > MAX_DEPTH or "".join(self.rest).strip() not in ("}", ""):
            return None
        try:
            arguments = json.loads("".join(self.arguments), parse_constant=_not_json)
        except ValueError:
            return None
        return arguments if isinstance(arguments, dict) else None


def _not_json(word: str):
    raise ValueError(f"{word} is not JSON")  # NaN, Infinity: Python reads them, no JSON client does


@dataclass
class ToolCallStream:
    """Answer text in, events out: plain text as TextPiece, each `<tool_call>` block as a
    CallStart (once its name is known) and CallArguments pieces. Text that could still turn
    into a block's opening is held back until it cannot. A block whose head
    (`{"name": "...", "arguments": {`) does not come within its first HEAD_MAX characters is
    given back as text; after the head, the call stands, its arguments as written (cut short
    if the answer ends inside them).

    whole: calls only once their block ends, and only those whose arguments parse as an
    object (see `_Block.arguments_object`); any other block is given back as text. Each
    feed costs O(its text) (plus HEAD_MAX while a head is awaited)."""

    whole: bool = False
    pending: str = ""  # text not yet classified (at most a marker's length)
    block: _Block | None = None
    after_call: bool = False  # a block just closed: a newline next is the separator between calls
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        text, self.pending = self.pending + text, ""
        if self.after_call and text:
            text, self.after_call = text.removeprefix("\n"), False
        i = 0
        while i < len(text):
            marker = CALL_OPEN if self.block is None else CALL_CLOSE
            at = text.find(marker, i)
            end = len(text) - _partial_suffix(text, marker, i) if at < 0 else at
            if self.block is None:
                if end > i:
                    events.append(TextPiece(text[i:end]))
            else:
                events += self._grow(text[i:end])
            if at < 0:
                self.pending = text[end:]
                break
            i = at + len(marker)
            if self.block is None:
                self.block = _Block()
                continue
            events += self._close(closed=True)
            self.after_call = i == len(text)
            i += text.startswith("\n", i)  # the template's separator between calls
        return events

    def finish(self) -> list[Event]:
        """The answer ended: what was held back, and a block left open closed as it stands."""
        events: list[Event] = []
        if self.block is not None:
            events += self._grow(self.pending) + self._close(closed=False)
        elif self.pending:
            events.append(TextPiece(self.pending))
        self.pending = ""
        return events

    def _grow(self, piece: str) -> list[Event]:
        """The open block's next piece: its CallStart once the head is read, then pieces of
        its arguments (streaming calls)."""
        block, events = self.block, []
        block.text.append(piece)
        if block.name is None:
            if block.head is None or (piece := block.read_head(piece)) is None:
                return events
            if not self.whole:
                block.start = CallStart(len(self.calls), new_call_id(), block.name)
                events.append(block.start)
        arguments = block.grow(piece)
        if block.start is not None and arguments:
            events.append(CallArguments(block.start.index, arguments))
        return events

    def _close(self, closed: bool) -> list[Event]:
        """The block ended (at `</tool_call>`, or with the answer when not `closed`): the call
        it holds, or its text back."""
        block, self.block = self.block, None
        if block.name is None or (self.whole and block.arguments_object() is None):
            return [TextPiece(CALL_OPEN + "".join(block.text) + (CALL_CLOSE if closed else ""))]
        start = block.start or CallStart(len(self.calls), new_call_id(), block.name)
        self.calls.append(ToolCall(start.id, start.name, "".join(block.arguments)))
        return []


def parse_answer(text: str, whole: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (its text outside tool-call blocks, the calls); `whole` as in
    ToolCallStream."""
    stream = ToolCallStream(whole)
    events = stream.feed(text) + stream.finish()
    return "".join(e.text for e in events if isinstance(e, TextPiece)), stream.calls
