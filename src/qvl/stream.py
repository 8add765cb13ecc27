"""Token ids -> text events: incremental detokenising, stop strings, usage and timings.
Every front door consumes these events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from qvl.processing.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Usage:
    prompt_tokens: int = 0
    image_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    vision_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms_per_token: float = 0.0
    decode_ms: list[float] = field(default_factory=list, repr=False)  # per decoded token
    cached: dict[str, bool] = field(default_factory=dict)  # per stage: vision, prefix, answer
    reused_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled


@dataclass
class Delta:
    """A piece of answer text; concatenating all deltas gives the final text."""

    text: str
    token_ids: list[int]


@dataclass
class Done:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    usage: Usage
    timings: Timings

    def to_dict(self) -> dict:
        timings = asdict(self.timings)
        timings.pop("decode_ms")
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {**asdict(self.usage), "total_tokens": self.usage.total_tokens},
            "timings": timings,
        }


class StopStrings:
    """Finds the first stop string; holds back only a tail that could still grow into one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def _partial_tail(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = len(self.pending) - self._partial_tail()
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def stream_text(
    token_steps: Iterator[int], tokenizer: Tokenizer, stops: tuple[str, ...], eos_ids: tuple[int, ...],
    usage: Usage, timings: Timings, started: float,
) -> Iterator[Delta | Done]:
    """Turn one row's token ids into Delta events and a final Done.

    `started` is the perf_counter at which the request began (for time to first token);
    timings.vision_ms is expected filled in already."""
    decoder, stopper = StreamDecoder(tokenizer), StopStrings(stops)
    ids: list[int] = []
    text_parts: list[str] = []
    finish, hit_stop_string, last = "length", False, None
    for token in token_steps:
        now = time.perf_counter()
        if last is None:
            timings.ttft_ms = (now - started) * 1000
            timings.prefill_ms = max(0.0, timings.ttft_ms - timings.vision_ms)
        else:
            timings.decode_ms.append((now - last) * 1000)
        last = now
        ids.append(token)
        if token in eos_ids:
            finish = "stop"
            break
        text, hit_stop_string = stopper.push(decoder.push(token))
        if text:
            text_parts.append(text)
            yield Delta(text, [token])
        if hit_stop_string:
            finish = "stop"
            break
    if not hit_stop_string:
        tail, hit_stop_string = stopper.push(decoder.flush())
        tail += "" if hit_stop_string else stopper.flush()
        finish = "stop" if hit_stop_string else finish
        if tail:
            text_parts.append(tail)
            yield Delta(tail, [])
    usage.completion_tokens = len(ids)
    if timings.decode_ms:
        timings.decode_ms_per_token = sum(timings.decode_ms) / len(timings.decode_ms)
    yield Done("".join(text_parts), ids, finish, usage, timings)
