"""The scheduler: every request the engine answers runs through it. It owns the running
sequences, admits waiting ones between decode steps (first come, first served), prefills
them in bounded slices, decodes all rows that are generating together in one pass per
step, and retires a row the moment it finishes (EOS, stop string, token limit, cancellation).

Each sequence has its own cache row, its own length (the scheduler counts; the model writes
where it is told) and its own sampling parameters and generator, and a row only ever
attends to its own positions: what a request generates does not depend on what else runs.
One thread drives `step`; `submit` and `cancel` may come from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qvl.generate import PREFILL_CHUNK, CancelCheck, Cancelled, PreparedPrompt, decode_step, new_cache, prefill_slice
from qvl.kv_cache import KVCache
from qvl.requests import ParsedRequest
from qvl.sampling import SamplingParams, apply_penalties, sample
from qvl.stream import Delta, Done, TextStream, Timings, Usage

DEFAULT_MAX_BATCH = 8  # rows decoded together; the native GEMVs take up to 16
PREFILL_TOKENS_ALONE = PREFILL_CHUNK  # prompt tokens per step when no row is generating
PREFILL_TOKENS_SHARED = 128  # ... and while rows are generating: their next token waits for the slice

Event = Delta | Done | BaseException  # what a sequence emits; an exception ends it unanswered


@dataclass(eq=False)  # compared by identity
class Sequence:
    """One request inside the scheduler."""

    parsed: ParsedRequest
    emit: Callable[[Event], None]  # called on the driving thread, in order
    cancel: CancelCheck | None = None
    started: float | None = None  # perf_counter the time to first token counts from (None: admission)
    on_start: Callable[[], None] | None = None  # called when admitted (left the queue)
    timings: Timings = field(default_factory=Timings)
    # set by the scheduler
    spans: list = field(default_factory=list)
    prompt: PreparedPrompt | None = None
    prefix: tuple[KVCache, int] | None = None
    row: int = -1  # cache row while running
    filled: int = 0  # cache slots holding this sequence's tokens
    position: int = 0  # M-RoPE position of the next token fed
    logits: torch.Tensor | None = None  # [V] float32: the next token's
    seen: torch.Tensor | None = None  # [V] bool: prompt + output tokens (repetition penalty)
    counts: torch.Tensor | None = None  # [V] float32: output-token counts (presence/frequency penalties)
    generator: torch.Generator | None = None
    text: TextStream | None = None
    stopped: str | None = None  # why it was cancelled from outside
    done: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.parsed.sampling

    @property
    def prefilling(self) -> bool:
        return self.logits is None


class Scheduler:
    def __init__(self, engine, max_batch: int = DEFAULT_MAX_BATCH):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine, self.max_batch = engine, max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.cache: KVCache | None = None
        self.lock = threading.Lock()
        self.steps = 0

    @property
    def model(self):
        return self.engine.model

    def submit(self, seq: Sequence) -> None:
        with self.lock:
            self.waiting.append(seq)

    def stop(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a sequence before the scheduler's next step touches it (any thread)."""
        seq.stopped = seq.stopped or reason

    @property
    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and not self.running

    def step(self) -> None:
        """Admit what fits, run one prefill slice, then one decode step for every generating
        row. Sequences finish inside, through their `emit`."""
        self.steps += 1
        self._drop_stopped()
        self._admit()
        generating = [s for s in self.running if not s.prefilling]
        pending = next((s for s in self.running if s.prefilling), None)
        if pending is not None:
            self._prefill(pending, PREFILL_TOKENS_SHARED if generating else PREFILL_TOKENS_ALONE)
        self._decode([s for s in self.running if not s.prefilling])
        if not self.running:
            self.cache = None  # nothing held between bursts of requests

    # -- admission and prefill -------------------------------------------------------------

    def _admit(self) -> None:
        """At most one sequence per step (its images are encoded here, seconds for a photo):
        rows already generating wait for one admission at a time, not for a burst of them."""
        if len(self.running) >= self.max_batch:
            return
        with self.lock:
            if not self.waiting:
                return
            seq = self.waiting.popleft()
        try:
            self._start(seq)
        except Exception as exc:  # one request's images, budget or cancellation: it alone fails
            self._fail(seq, exc)

    def _start(self, seq: Sequence) -> None:
        """Prefix reuse, vision (through the image cache) and a cache row."""
        engine, params = self.engine, seq.params
        if seq.stopped:
            raise Cancelled(seq.stopped)
        if seq.started is None:
            seq.started = time.perf_counter()
        if seq.on_start is not None:
            seq.on_start()
        seq.spans = engine.spans(seq.parsed)
        seq.prompt, seq.prefix = engine.prepare_from_prefix(seq.parsed, seq.spans, seq.timings, seq.cancel)
        needed = len(seq.prompt) + params.max_new_tokens
        used = {s.row for s in self.running}
        row = next(r for r in range(self.max_batch) if r not in used)
        self._make_room(needed)
        seq.row, seq.position = row, seq.prompt.next_position
        seq.filled = 0
        if seq.prefix is not None:
            kv, n = seq.prefix
            self.cache.row(row).write_prefix(kv, n)
            seq.filled = n
        vocab = self.model.cfg.text.vocab_size
        if params.repetition_penalty != 1.0:
            seq.seen = torch.zeros(vocab, dtype=torch.bool)
            ids = seq.prompt.ids
            seq.seen[ids[ids < vocab]] = True
        if params.presence_penalty or params.frequency_penalty:
            seq.counts = torch.zeros(vocab)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        usage = Usage(prompt_tokens=len(seq.parsed.ids), image_tokens=seq.parsed.image_tokens)
        seq.text = TextStream(engine.tokenizer, params.stop, engine.eos_ids(params), usage, seq.timings, seq.started)
        self.running.append(seq)

    def _make_room(self, needed: int) -> None:
        """A cache with max_batch rows of at least `needed` slots; growing keeps every running
        row's filled slots (positions are resident only once written)."""
        if self.cache is not None and self.cache.capacity >= needed:
            return
        capacity = needed
        if self.cache is not None:  # double, so that a stream of longer requests grows it rarely
            capacity = max(needed, min(2 * self.cache.capacity, self.engine.limits.max_context))
        bigger = new_cache(self.model, self.max_batch, capacity)
        for s in self.running:
            bigger.keys[:, s.row, :, : s.filled] = self.cache.keys[:, s.row, :, : s.filled]
            bigger.values[:, s.row, :, : s.filled] = self.cache.values[:, s.row, :, : s.filled]
        self.cache = bigger

    def _prefill(self, seq: Sequence, budget: int) -> None:
        """The next `budget` prompt tokens of one sequence; its first token's logits at the end."""
        try:
            if seq.cancel is not None and seq.cancel():
                raise Cancelled()
            end = min(len(seq.prompt), seq.filled + budget)
            logits = prefill_slice(self.model, self.cache.row(seq.row), seq.prompt, seq.filled, end)
            seq.filled = end
            if end == len(seq.prompt):
                seq.logits = logits[0].float()
        except Exception as exc:
            self._retire(seq, exc)

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self, seqs: list[Sequence]) -> None:
        """Sample each row's next token from its own logits and parameters; retire the rows
        that finish; feed the rest through one decode step together."""
        fed: list[tuple[Sequence, int]] = []
        for seq in seqs:
            if seq.cancel is not None and seq.cancel():
                self._retire(seq, Cancelled())
                continue
            token = self._sample(seq)
            delta = seq.text.push(token)
            if delta is not None:
                seq.emit(delta)
            if seq.text.finished or len(seq.text.ids) >= seq.params.max_new_tokens:
                self._retire(seq)
            else:
                fed.append((seq, token))
        if not fed:
            return
        rows = torch.tensor([s.row for s, _ in fed])
        slots = torch.tensor([s.filled for s, _ in fed])
        positions = torch.tensor([s.position for s, _ in fed])
        tokens = torch.tensor([t for _, t in fed])
        try:
            logits = decode_step(self.model, self.cache, tokens, slots, positions, rows).float()
        except Exception as exc:  # the step failed for every row in it
            for seq, _ in fed:
                self._retire(seq, exc)
            return
        for i, (seq, _) in enumerate(fed):
            seq.logits = logits[i]
            seq.filled += 1
            seq.position += 1

    def _sample(self, seq: Sequence) -> int:
        params, logits = seq.params, seq.logits[None]
        if seq.seen is not None or seq.counts is not None:
            vocab = logits.shape[-1]
            seen = seq.seen[None] if seq.seen is not None else torch.zeros(1, vocab, dtype=torch.bool)
            counts = seq.counts[None] if seq.counts is not None else torch.zeros(1, vocab)
            logits = apply_penalties(logits, seen, counts, params)
        token = int(sample(logits, params, None if seq.generator is None else [seq.generator])[0])
        if seq.seen is not None:
            seq.seen[token] = True
        if seq.counts is not None:
            seq.counts[token] += 1
        return token

    # -- finishing --------------------------------------------------------------------------

    def _drop_stopped(self) -> None:
        for seq in [s for s in self.running if s.stopped]:
            self._retire(seq, Cancelled(seq.stopped))
        with self.lock:
            gone = [s for s in self.waiting if s.stopped]
            for seq in gone:
                self.waiting.remove(seq)
        for seq in gone:
            self._fail(seq, Cancelled(seq.stopped))

    def _retire(self, seq: Sequence, error: BaseException | None = None) -> None:
        """Take a running sequence out: its Done (kept for prefix reuse and exact repeats), or
        the error that ended it."""
        self.running.remove(seq)
        if error is not None:
            self._fail(seq, error)
            return
        tail, done = seq.text.close()
        seq.done = True
        if tail is not None:
            seq.emit(tail)
        self.engine.remember(seq.parsed, seq.spans, self.cache.row(seq.row), seq.filled, done)
        seq.emit(done)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        seq.done = True
        seq.emit(error)
