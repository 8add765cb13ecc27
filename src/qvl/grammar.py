"""Constrained decoding: a JSON schema, a regular expression or a Lark grammar turned into a
per-token mask over the vocabulary, with llguidance (see docs/api.md for why that engine).

A `Constraint` names what the answer must match; `Grammars` (one per engine) compiles it
once (checking it as a request is parsed, so a bad one is a 400 before queueing) and hands
each row its own `Guide`, which masks the row's logits and follows the tokens it samples.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from qvl.requests import RequestError

# JSON as a person writes it on one line ({"a": 1, "b": [2, 3]}): no free whitespace, which a
# model could otherwise spin in for ever (and which costs tokens on a CPU).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
KINDS = ("json_schema", "regex", "lark")
COMPILED_KEPT = 64  # compiled grammars kept (a service sees a handful of schemas again and again)


@dataclass(frozen=True)
class Constraint:
    """What an answer must match. kind: json_schema (source: the schema as JSON text),
    regex, or lark (a Lark grammar as llguidance reads it: `%json {...}` embeds a schema,
    `<[id]>` a token by id)."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a constraint's kind is one of {', '.join(KINDS)}, not '{self.kind}'")

    @classmethod
    def json(cls, schema: dict | None = None) -> Constraint:
        """Any JSON object (schema None), or JSON valid under `schema` (objects closed: see
        `closed`), laid out on one line."""
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, dict):
            raise RequestError("a JSON schema must be a JSON object", "response_format")
        return cls("json_schema", json.dumps(with_layout(closed(schema)), ensure_ascii=False))

    @property
    def name(self) -> str:
        return {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar"}[self.kind]

    def problem(self) -> str | None:
        """Why llguidance cannot enforce this constraint (one line), or None; needs no
        tokenizer, so a command line can check it before any model loads."""
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(self.kind, self.source))
        except Exception as exc:  # llguidance raises ValueError, or its own errors, for text it cannot read
            error = str(exc)
        if not error:
            return None
        lines = [line.strip() for line in error.splitlines()]  # without its echo of the source and caret line
        return " ".join(line for line in lines if line and not re.fullmatch(r"\^+|\d+ \|.*", line))


SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def closed(schema):
    """The schema with every object that lists its properties and says nothing of others
    closed to others (additionalProperties false), as llama.cpp, Ollama and OpenAI's strict
    mode read it: the answer has the fields asked for, not a model's extra ones (which could
    run on for ever). `additionalProperties: true` keeps an object open. allOf members are
    left as written (closing each would forbid the others' properties)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = closed(out[key])
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out) \
            and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def with_layout(schema: dict) -> dict:
    """The schema with llguidance's layout options (the schema's own, if it sets them, win)."""
    options = {**JSON_LAYOUT, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary (the tokenizer's index, ~1 s,
    is built on first use) and keeps the compiled ones, so a schema seen before costs
    nothing. Thread-safe: the server parses requests in several threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._index = None
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()

    def index(self):
        """llguidance's view of the tokenizer (built once)."""
        with self._lock:
            if self._index is None:
                import llguidance

                self._index = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_ids))
            return self._index

    def compile(self, constraint: Constraint, param: str = "response_format"):
        """The compiled matcher (a pristine one, never advanced); raises RequestError naming
        `param` for a grammar llguidance cannot enforce, its runtime limits included (checked
        on the answer's first token, see `Guide.first_step_error`)."""
        with self._lock:
            matcher = self._compiled.get(constraint)
            if matcher is not None:
                self._compiled.move_to_end(constraint)
                return matcher
        import llguidance

        index = self.index()
        try:
            grammar = llguidance.grammar_from(constraint.kind, constraint.source)
        except Exception as exc:  # a schema that is not JSON, a regex that does not parse
            raise RequestError(f"invalid {constraint.kind.replace('_', ' ')}: {exc}", param,
                               "invalid_grammar") from None
        matcher = llguidance.LLMatcher(index, grammar, log_level=0)
        error = matcher.get_error() or Guide(matcher.deep_copy(), self.vocab_size).first_step_error()
        if error:
            raise RequestError(f"cannot enforce this {constraint.kind.replace('_', ' ')}: {error}",
                               param, "invalid_grammar")
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher

    def guide(self, constraint: Constraint) -> Guide:
        return Guide(self.compile(constraint).deep_copy(), self.vocab_size)

    def warm_up(self) -> None:
        """Build the tokenizer index (~1 s, once per process) and run one mask through it, so
        the first constrained request does not wait for either."""
        self.guide(Constraint.json()).mask(torch.zeros(1, self.vocab_size))


class Guide:
    """One row's constraint state: which tokens may come next, advanced token by token."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)  # bit i of the row: token i allowed

    def allowed(self) -> np.ndarray:
        """[V] uint8: 1 where the constraint allows the token next. The bits are unpacked with
        numpy (~0.1 ms): llguidance.torch's own kernel is a torch.compile function whose
        first call takes seconds and a C++ compiler."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        return np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] float32 with every token the constraint forbids at -inf (in place)."""
        logits.masked_fill_(torch.from_numpy(self.allowed() == 0)[None], float("-inf"))
        return logits

    def first_step_error(self) -> str | None:
        """llguidance's error on the answer's first step (the mask, then the lowest token it
        allows: when the grammar forces a start, that start), or None; advances this guide.
        A grammar can compile and still need more lexer states or parser items than
        llguidance allows as soon as decoding starts (`a{1000000}`, a 20,000-way choice, a
        required `$ref` cycle): such a one is refused with a request, not met mid-answer."""
        allowed = np.flatnonzero(self.allowed())
        if len(allowed):
            self.matcher.consume_token(int(allowed[0]))
        return self.matcher.get_error().split("\n<", 1)[0].strip() or None  # without its state dump

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the constraint: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The answer matched and nothing may follow: the row ends here."""
        return self.matcher.is_stopped()
