"""Token ids -> text events: incremental detokenising, stop strings, usage and timings.
Every front door consumes these events."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from qvl.processing.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    import torch


@dataclass
class Usage:
    prompt_tokens: int = 0
    image_tokens: int = 0
    video_tokens: int = 0  # of the prompt's tokens: video frame pairs' (with image_tokens, what the vision tower made)
    completion_tokens: int = 0  # reasoning tokens included, as OpenAI counts them
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    parse_ms: float = 0.0  # decoding images and videos, tokenizing: when inside ttft_ms (a request handed over unparsed)
    vision_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms_per_token: float = 0.0
    decode_ms: list[float] = field(default_factory=list, repr=False)  # per decoded token
    cached: dict[str, bool] = field(default_factory=dict)  # per stage: vision, prefix, answer
    reused_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model, and its best alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class Delta:
    """A piece of answer text (or of a Thinking model's reasoning); concatenating all deltas
    gives the final text (and reasoning)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # the tokens whose text this delta completes (when asked)
    index: int = 0  # which of the request's n answers
    reasoning: str = ""


@dataclass
class Done:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    usage: Usage
    timings: Timings
    logprobs: list[TokenLogprob] | None = None  # one per token (when asked)
    index: int = 0  # which of the request's n answers
    reasoning: str | None = None  # a Thinking model's reasoning (None: the prompt opened none)
    hidden: torch.Tensor | None = None  # [D] float32: a request that ends after its prefill (embeddings,
    # reranking) is answered with its last token's final-normed hidden state, no text

    def to_dict(self) -> dict:
        timings = asdict(self.timings)
        timings.pop("decode_ms")
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {**asdict(self.usage), "total_tokens": self.usage.total_tokens},
            "timings": timings,
        }
        if self.logprobs is not None:
            out["logprobs"] = [asdict(lp) for lp in self.logprobs]
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        return out


class StopStrings:
    """Finds the first stop string as the text streams in (the first to end; of two ending on
    the same character, the longer); holds back only a tail that could still grow into one.
    Each stop string follows the text with a KMP automaton, so each character is read once
    per stop string (and held back and let go once), however long the strings are and
    however the text arrives."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.fallbacks = [_fallback(s) for s in self.stops]
        self.matched = [0] * len(self.stops)  # per stop string: its longest prefix that ends the text so far
        self.pending: deque[str] = deque()  # held back, a character each: the last max(matched) characters

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        for at, char in enumerate(text):
            if ended := self._step(char):
                self.pending.extend(text[: at + 1])
                out = "".join(islice(self.pending, len(self.pending) - ended))
                self.pending.clear()
                return out, True
        self.pending.extend(text)
        let_go = len(self.pending) - max(self.matched)
        return "".join([self.pending.popleft() for _ in range(let_go)]), False

    def _step(self, char: str) -> int:
        """Every stop string reads the next character: the length of the longest one it
        completes, or 0."""
        ended = 0
        for k, stop in enumerate(self.stops):
            fallback, m = self.fallbacks[k], self.matched[k]
            while m and stop[m] != char:
                m = fallback[m - 1]
            if stop[m] == char:
                m += 1
                if m == len(stop):
                    ended, m = max(ended, m), fallback[m - 1]
            self.matched[k] = m
        return ended

    def flush(self) -> str:
        out = "".join(self.pending)
        self.pending.clear()
        return out


def _fallback(stop: str) -> list[int]:
    """KMP's table: for each prefix stop[:i + 1], the length of its longest proper prefix that
    is also its suffix."""
    table, m = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while m and stop[i] != stop[m]:
            m = table[m - 1]
        m += stop[i] == stop[m]
        table[i] = m
    return table


class Reasoning:
    """A Thinking model's reasoning, from the `<think>` its prompt opened to `</think>`: its
    text (the newlines around it dropped, as the chat template writes them back) and whether
    it is still going."""

    def __init__(self, tokenizer: Tokenizer, end_id: int):
        self.decoder, self.end_id = StreamDecoder(tokenizer), end_id
        self.open, self.tokens = True, 0
        self.parts: list[str] = []
        self.newlines = ""  # trailing newlines held back: dropped if `</think>` follows

    def push(self, token: int) -> str:
        """The reasoning text this token completes; `</think>` closes it."""
        if token == self.end_id:
            self.open = False
            return self.flush()
        self.tokens += 1
        return self._take(self.decoder.push(token))

    def flush(self) -> str:
        """The text held back until now (its trailing newlines dropped): the reasoning ended."""
        return self._take(self.decoder.flush(), last=True)

    def _take(self, text: str, last: bool = False) -> str:
        if not self.parts and not self.newlines:
            text = text.lstrip("\n")
        text, self.newlines = self.newlines + text, ""
        if not last:
            stripped = text.rstrip("\n")
            text, self.newlines = stripped, text[len(stripped):]
        else:
            text = text.rstrip("\n")
        if text:
            self.parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.parts)


class TextStream:
    """One row's token ids -> Delta events and a final Done, pushed one token at a time:
    incremental detokenising, a Thinking model's reasoning apart (when the prompt opened
    `<think>`: `think_end` is then the id of `</think>`), EOS and stop strings (on the answer),
    usage and timings. `started` is the perf_counter at which the request began (for time
    to first token); timings.vision_ms is expected filled in already."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], eos_ids: tuple[int, ...], usage: Usage,
                 timings: Timings, started: float, index: int = 0, think_end: int | None = None):
        self.index = index
        self.reasoning = Reasoning(tokenizer, think_end) if think_end is not None else None
        self.answer_started = False  # the answer's leading newlines (after `</think>`) are dropped
        self.decoder, self.stopper, self.eos_ids = StreamDecoder(tokenizer), StopStrings(stops), eos_ids
        self.usage, self.timings, self.started = usage, timings, started
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.finish_reason, self.hit_stop_string, self.last = "length", False, None
        self.finished = False
        self.logprobs: list[TokenLogprob] | None = None
        self.unsent = 0  # logprobs not yet sent with a delta

    def push(self, token: int, logprob: TokenLogprob | None = None) -> Delta | None:
        """Take the next token (and its logprob, when asked); returns the text it completes,
        if any, with the logprobs of the tokens behind that text. After EOS or a stop string
        `finished` is true and the row must stop (take no more tokens)."""
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        now = time.perf_counter()
        if self.last is None:
            self.timings.ttft_ms = (now - self.started) * 1000
            self.timings.prefill_ms = max(0.0, self.timings.ttft_ms - self.timings.vision_ms - self.timings.parse_ms)
        else:
            self.timings.decode_ms.append((now - self.last) * 1000)
        self.last = now
        self.ids.append(token)
        if token in self.eos_ids:
            self.finish_reason, self.finished = "stop", True
            return None
        if self.thinking:
            piece = self.reasoning.push(token)
            return Delta("", [token], self._unsent(), self.index, piece) if piece else None
        decoded = self.decoder.push(token)
        if self.reasoning is not None and not self.answer_started:
            decoded = decoded.lstrip("\n")
            self.answer_started = bool(decoded)
        text, self.hit_stop_string = self.stopper.push(decoded)
        if self.hit_stop_string:
            self.finish_reason, self.finished = "stop", True
        if text:
            self.parts.append(text)
            return Delta(text, [token], self._unsent(), self.index)
        return None

    @property
    def thinking(self) -> bool:
        """Inside the reasoning: the tokens go there, not into the answer."""
        return self.reasoning is not None and self.reasoning.open

    def complete(self) -> None:
        """The answer is whole (its grammar allows nothing more): it ends as if at EOS."""
        self.finish_reason, self.finished = "stop", True

    def _unsent(self) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        out, self.unsent = self.logprobs[self.unsent :], len(self.logprobs)
        return out

    def close(self) -> tuple[Delta | None, Done]:
        """No more tokens: the held-back tail (unless a stop string ended it) and the Done."""
        tail = None
        if self.thinking:  # ended inside the reasoning (EOS, the token cap): its held-back text
            piece = self.reasoning.flush()
            if piece:
                tail = Delta("", [], self._unsent(), self.index, piece)
        if not self.hit_stop_string:
            text, self.hit_stop_string = self.stopper.push(self.decoder.flush())
            text += "" if self.hit_stop_string else self.stopper.flush()
            self.finish_reason = "stop" if self.hit_stop_string else self.finish_reason
            if text:
                self.parts.append(text)
                tail = Delta(text, [], self._unsent(), self.index, tail.reasoning if tail else "")
        self.finished = True
        self.usage.completion_tokens = len(self.ids)
        if self.reasoning is not None:
            self.usage.reasoning_tokens = self.reasoning.tokens + (not self.reasoning.open)  # `</think>` counts
        if self.timings.decode_ms:
            self.timings.decode_ms_per_token = sum(self.timings.decode_ms) / len(self.timings.decode_ms)
        return tail, Done("".join(self.parts), self.ids, self.finish_reason, self.usage, self.timings, self.logprobs,
                          self.index, None if self.reasoning is None else self.reasoning.text)
