"""Items -> result rows with one engine. Each item is parsed on its own, so a broken image
becomes that item's error row and never reaches the scheduler; the good ones are decoded
together, `batch_size` in flight, each replaced by the next item the moment it finishes.
Shared by the local and the Ray runner."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from qvl.batch.inputs import Item
from qvl.engine import Engine, EngineOptions, Request
from qvl.grounding import grounding
from qvl.options import SamplingOptions
from qvl.sampling import SamplingParams
from qvl.scheduler import Sequence
from qvl.stream import Done


@dataclass(frozen=True)
class WorkSpec:
    """What a worker needs to build its engine; picklable, so a Ray actor can build its own."""

    options: EngineOptions
    sampling: SamplingOptions  # its constraint, if any, already read from --json-schema etc.
    prompt: str | None  # for items without their own
    batch_size: int


def error_row(item: Item, prompt: str | None, exc: BaseException) -> dict:
    expected = isinstance(exc, (ValueError, OSError))
    message = str(exc) if expected else f"internal error: {type(exc).__name__}: {exc}"
    return {"id": item.id, **item.fields(), "prompt": prompt, "error": message}


class Worker:
    def __init__(self, engine: Engine, params: SamplingParams, prompt: str | None, batch_size: int,
                 grounding: bool = False, template_kwargs: dict | None = None):
        """grounding: rows carry the answer's boxes and points in their image's pixels;
        template_kwargs: more chat template variables for every item (Request.template_kwargs)."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.engine, self.params, self.prompt, self.batch_size = engine, params, prompt, batch_size
        self.grounding = grounding
        self.template_kwargs = template_kwargs or {}
        self.shown: dict[str, tuple[int, int] | None] = {}  # item id -> its image's size, until its row
        engine.scheduler.slice_s = None  # nobody watches tokens arrive: whole prefills, fewer weight passes

    @classmethod
    def from_spec(cls, spec: WorkSpec) -> Worker:
        engine = Engine.load(spec.options)
        return cls(engine, spec.sampling.params(engine), spec.prompt, spec.batch_size,
                   grounding=spec.sampling.grounding, template_kwargs=spec.sampling.template_kwargs)

    def request(self, item: Item) -> Request:
        kind = "video" if item.kind == "video" else "image"  # a PDF's page is an image
        content = [{"type": kind, kind: item.source}, {"type": "text", "text": self.prompt_for(item)}]
        return Request([{"role": "user", "content": content}], self.params, template_kwargs=self.template_kwargs)

    def prompt_for(self, item: Item) -> str | None:
        return item.prompt if item.prompt is not None else self.prompt

    def rows(self, items: Iterable[Item]) -> Iterator[dict]:
        """One row per item, in the items' order. Up to `batch_size` items are in the scheduler
        at once; each one that finishes is replaced by the next item at once (no row waits for
        a group). A broken item becomes its error row and never reaches the scheduler."""
        source = iter(items)
        order: deque[list] = deque()  # [item, row or None], in input order
        in_flight = 0

        def answered(slot: list, event) -> None:
            nonlocal in_flight
            if isinstance(event, (Done, BaseException)):
                slot[1] = self._row(slot[0], event)
                in_flight -= 1

        while True:
            while in_flight < self.batch_size and (item := next(source, None)) is not None:
                slot = [item, None]
                order.append(slot)
                try:
                    parsed = self.engine.parse(self.request(item))
                except Exception as exc:  # a bad item must not stop the run
                    slot[1] = error_row(item, self.prompt_for(item), exc)
                    continue
                self.shown[item.id] = parsed.last_image_size
                if (hit := self.engine.cached_answer(parsed)) is not None:
                    slot[1] = self._row(item, hit)
                    continue
                in_flight += 1
                self.engine.scheduler.submit(Sequence(parsed, lambda e, slot=slot: answered(slot, e)))
            while order and order[0][1] is not None:
                yield order.popleft()[1]
            if not order:
                return
            self.engine.scheduler.step()

    def _row(self, item: Item, done: Done | BaseException) -> dict:
        shown = self.shown.pop(item.id, None)
        if isinstance(done, BaseException):
            return error_row(item, self.prompt_for(item), done)
        answer = done.to_dict()
        answer.pop("token_ids")
        row = {"id": item.id, **item.fields(), "prompt": self.prompt_for(item), **answer}
        if self.params.constraint is not None and self.params.constraint.kind == "json_schema":
            row.update(json_fields(done))
        if self.grounding:
            row.update(grounding(done.text, shown))
        return row


def json_fields(done: Done) -> dict:
    """An answer under a JSON schema: {"json": the parsed object}, or {"error": why it does not
    parse} (the row keeps its text, and counts as failed, so --retry-errors runs it again)."""
    try:
        return {"json": json.loads(done.text)}
    except json.JSONDecodeError as exc:
        if done.finish_reason == "length":
            return {"error": f"the answer reached the token limit ({done.usage.completion_tokens} tokens) before "
                             "its JSON was complete: raise --max-new-tokens"}
        return {"error": f"the answer is not valid JSON ({exc.msg}): a --stop string may have cut it"}
