"""Items -> result rows with one engine. Each item is parsed on its own, so a broken image
becomes that item's error row and never reaches a batch; the good ones are decoded together
in groups of `batch_size` (`Engine.generate_batch`, through the scheduler). Shared by the
local and the Ray runner."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from qvl.batch.inputs import Item
from qvl.engine import Engine, EngineOptions, ParsedRequest, Request
from qvl.sampling import SamplingParams


@dataclass(frozen=True)
class WorkSpec:
    """What a worker needs to build its engine; picklable, so a Ray actor can build its own."""

    options: EngineOptions
    sampling: argparse.Namespace  # parsed flags; `qvl.cli.sampling_params` reads the sampling ones
    prompt: str | None  # for items without their own
    batch_size: int


def error_row(item: Item, prompt: str | None, exc: BaseException) -> dict:
    expected = isinstance(exc, (ValueError, OSError))
    message = str(exc) if expected else f"internal error: {type(exc).__name__}: {exc}"
    return {"id": item.id, "image": item.image, "prompt": prompt, "error": message}


class Worker:
    def __init__(self, engine: Engine, params: SamplingParams, prompt: str | None, batch_size: int):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.engine, self.params, self.prompt, self.batch_size = engine, params, prompt, batch_size

    @classmethod
    def from_spec(cls, spec: WorkSpec) -> Worker:
        from qvl.cli import sampling_params

        engine = Engine.load(spec.options)
        return cls(engine, sampling_params(engine, spec.sampling), spec.prompt, spec.batch_size)

    def request(self, item: Item) -> Request:
        content = [{"type": "image", "image": item.image}, {"type": "text", "text": self.prompt_for(item)}]
        return Request([{"role": "user", "content": content}], self.params)

    def prompt_for(self, item: Item) -> str | None:
        return item.prompt if item.prompt is not None else self.prompt

    def rows(self, items: Iterable[Item]) -> Iterator[dict]:
        """One row per item: error rows as soon as parsing fails, answers per decoded batch."""
        good: list[tuple[Item, ParsedRequest]] = []
        for item in items:
            try:
                good.append((item, self.engine.parse(self.request(item))))
            except Exception as exc:  # a bad item must not stop the run
                yield error_row(item, self.prompt_for(item), exc)
                continue
            if len(good) == self.batch_size:
                yield from self._answer(good)
                good = []
        if good:
            yield from self._answer(good)

    def _answer(self, good: list[tuple[Item, ParsedRequest]]) -> list[dict]:
        """Decode a group together (the scheduler retires each row as it finishes); a row
        that fails becomes its own error row."""
        rows = []
        for (item, _), done in zip(good, self.engine.generate_batch([parsed for _, parsed in good])):
            if isinstance(done, Exception):
                rows.append(error_row(item, self.prompt_for(item), done))
                continue
            answer = done.to_dict()
            answer.pop("token_ids")
            rows.append({"id": item.id, "image": item.image, "prompt": self.prompt_for(item), **answer})
        return rows
