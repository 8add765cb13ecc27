"""The scheduler: every request the engine answers runs through it. It owns the running
sequences, admits waiting ones between decode steps (first come, first served, while rows
and KV blocks allow), encodes their images and prefills their prompts in bounded slices,
decodes all rows that are generating together in one pass per step, and retires a row the
moment it finishes (EOS, stop string, token limit, cancellation). A request for n answers is
prefilled once and forked into n rows that share its prompt's KV blocks. A request that
ends after its prefill (ParsedRequest.last_hidden: embeddings, reranking) is answered with its
prompt's last hidden state as soon as the prefill ends, and never decodes.

KV memory is one pool of fixed-size blocks (qvl.kv_cache) with a total budget: a sequence
takes blocks as it grows; requests that begin with the same tokens and images share the
blocks of that beginning, and blocks no sequence holds any more stay as the prefix cache
until the pool needs them. When the pool runs out, new requests wait, and a running row that
needs a block preempts the newest sequence, which goes back to the front of the queue and is
recomputed later: its prompt prefilled again (or found in the prefix cache) and its tokens so
far fed again through decode steps, so it goes on as if never stopped.

A hybrid model (Qwen3.5's Gated DeltaNet layers) also gives each running row a slot of
recurrent state (qvl.state_cache). A state cannot be cut back to an earlier position, so
prefills keep snapshots of it at multiples of SNAPSHOT_INTERVAL positions, and a row keeps
the last one its decoding passed; the prefix cache holds them beside the blocks they follow,
and a shared prefix for such a model ends where a snapshot is.

Each sequence has its own block table, its own length (the scheduler counts; the model
writes where it is told) and its own sampling parameters and generator, and a row only ever
attends to its own positions: what a request generates does not depend on what else runs.
One thread drives `step`; `submit` and `stop` may come from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from qvl.generate import PREFILL_CHUNK, CancelCheck, Cancelled, PreparedPrompt, decode_step, prefill_slice
from qvl.grammar import Guide
from qvl.kv_cache import BLOCK, KVCache, KVPool, block_hashes, blocks_for
from qvl.requests import ParsedRequest, RequestError
from qvl.sampling import SamplingParams, apply_logit_bias, apply_penalties, sample, top_logprobs
from qvl.state_cache import SNAPSHOT_BLOCKS, SNAPSHOT_INTERVAL, Snapshot, StatePool, StateRows, capture_points
from qvl.stream import Delta, Done, TextStream, Timings, TokenLogprob, Usage

DEFAULT_MAX_BATCH = 8  # rows decoded together; the native GEMVs take up to 16
# Prompt tokens per step when no row is generating: int8 weights are dequantised once per step,
# so long prompts gain from long steps (a 30 s clip's 1,114 tokens: prefill 2.9 s instead of 4.0 s
# at 512: docs/decisions/prefill-slices.md); the attention stays memory-efficient (~60 MB for
# 2048 queries over 6k keys).
PREFILL_TOKENS_ALONE = 4 * PREFILL_CHUNK
SLICE_S = 0.3  # while rows are generating: vision or prefill work per step (their next token waits for it)
MIN_SLICE_TOKENS = 64  # smaller prefill calls waste their weight passes (and would measure a falsely low rate),
MAX_FLOOR_S = 0.5  # unless 64 would hold the generating rows longer than this (plain AVX2: ~50-70 tokens/s)
LEAST_SLICE_TOKENS = 16  # the fewest a slice takes even then
DETERMINISTIC_CHUNK = 128  # with --deterministic: prefill runs in these aligned chunks, whatever the slice

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
    digests: list[bytes] | None = None  # prefix hashes of the prompt's full blocks (but its last token's)
    prompt: PreparedPrompt | None = None
    blocks: list[int] = field(default_factory=list)  # its KV blocks, in position order
    slot: int | None = None  # its recurrent-state slot (hybrid models)
    passed: Snapshot | None = None  # its state at the last multiple of SNAPSHOT_INTERVAL decoding passed
    hashed: int = 0  # leading blocks registered for sharing
    rows: int = 1  # rows it takes: n until its answers are forked, then 1
    filled: int = 0  # positions holding this sequence's tokens
    position: int = 0  # M-RoPE position of the next token fed
    replay: list[int] = field(default_factory=list)  # tokens generated before a preemption, still to feed again
    logits: torch.Tensor | None = None  # [V] float32: the next token's
    seen: torch.Tensor | None = None  # [V] bool: prompt + output tokens (repetition penalty)
    counts: torch.Tensor | None = None  # [V] float32: output-token counts (presence/frequency penalties)
    generator: torch.Generator | None = None
    guide: Guide | None = None  # the row's constraint (JSON schema, grammar), when the request has one
    text: TextStream | None = None
    preparing: Generator | None = None  # vision, run a few blocks per step
    stopped: str | None = None  # why it was cancelled from outside
    admitted: bool = False  # once: a preempted sequence is admitted again with its state kept
    done: bool = False
    index: int = 0  # which of the request's n answers (1.. are forked from 0 after its prefill)
    parent: Sequence | None = None  # the sequence a sibling was forked from (stopping it stops them all)

    @property
    def params(self) -> SamplingParams:
        return self.parsed.sampling

    @property
    def prefilling(self) -> bool:
        return self.logits is None


    @property
    def fed_ids(self) -> list[int]:
        """Its generated tokens whose keys and values its blocks hold."""
        return self.text.ids[: self.filled - len(self.parsed.ids)] if self.text is not None else []

    @property
    def stop_reason(self) -> str | None:
        return self.stopped or (self.parent.stopped if self.parent is not None else None)


def kv_bytes_per_position(model) -> int:
    """Keys and values of one token of one row, all attention layers, in the model's dtype."""
    t = model.cfg.text
    return 2 * len(t.attention_layers) * t.num_key_value_heads * t.head_dim * model.dtype.itemsize


def default_kv_budget_mb(model) -> float:
    """Half the memory available once the model is loaded, at most 8 GB (the KV pool; its
    pages become resident only as blocks are first written)."""
    import psutil

    return min(psutil.virtual_memory().available / 2, 8 * 2**30) / 2**20


class Scheduler:
    def __init__(self, engine, max_batch: int = DEFAULT_MAX_BATCH, kv_budget_mb: float | None = None,
                 prefix_cache_mb: float = 0):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine, self.max_batch = engine, max_batch
        mb = default_kv_budget_mb(engine.model) if kv_budget_mb is None else kv_budget_mb
        t = engine.model.cfg.text
        block_bytes = kv_bytes_per_position(engine.model) * BLOCK
        self.pool = KVPool(len(t.attention_layers), max(1, int(mb * 2**20) // block_bytes), t.num_key_value_heads,
                           t.head_dim, engine.model.dtype, int(prefix_cache_mb * 2**20))
        self.states = StatePool(t, max_batch, engine.model.dtype) if engine.model.cfg.hybrid else None
        self.turn_token = engine.tokenizer.find("<|im_start|>")  # where a chat message begins
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.lock = threading.Lock()
        self.steps = self.tokens = self.preemptions = 0  # totals, for /metrics
        self.last_step_s = 0.0
        self.last_rows = 0  # rows in the last decode step
        self.prefill_rate = 256.0  # prompt tokens/s, measured as slices run (sizes the slices)
        # work per step for a new request while rows generate, so that their tokens keep coming;
        # None: all of it at once (throughput first, as `qvl batch` wants: each prefill call
        # pays a pass over the weights, so slices cost time in all)
        self.slice_s: float | None = SLICE_S

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

    def stats(self) -> dict[str, float]:
        """What /metrics shows: running and waiting requests, rows and time of the last step,
        the KV pool's budget, blocks held, prefix-cache blocks and filled positions, totals."""
        with self.lock:
            waiting = len(self.waiting)
        running, pool = list(self.running), self.pool
        return {"running": len(running), "waiting": waiting, "last_step_rows": self.last_rows,
                "kv_budget_bytes": pool.blocks * pool.block_bytes,
                "kv_held_bytes": pool.held * pool.block_bytes,
                "kv_prefix_bytes": pool.stats.bytes,
                "kv_filled_bytes": sum(s.filled for s in running) * kv_bytes_per_position(self.model),
                "preemptions": self.preemptions,
                "last_step_seconds": self.last_step_s, "steps": self.steps, "tokens": self.tokens}

    @torch.inference_mode()
    def step(self) -> None:
        """Admit what fits; give the sequences not yet generating one slice of work (vision
        blocks, then runs of prompt tokens); then one decode step for every generating row.
        Sequences finish inside, through their `emit`. Once none is left, the threads placed
        while other programs were busy are let go (threads.Threads.rest)."""
        started = time.perf_counter()
        self.steps += 1
        with self.engine.threads.step():
            self._drop_stopped()
            self._admit()
            with self.engine.threads.prompt():
                self._prepare_and_prefill()
            self._decode([s for s in self.running if not s.prefilling])
        if self.idle:
            self.engine.threads.rest()
        self.last_step_s = time.perf_counter() - started

    # -- admission and prefill -------------------------------------------------------------

    def _rows_used(self) -> int:
        return sum(s.rows for s in self.running)

    def blocks_needed(self, parsed: ParsedRequest) -> int:
        """The most blocks a request may hold: its prompt's, shared by its n answers, and each
        answer's own from the prompt's last partial block to its token cap."""
        prompt, full = len(parsed.ids), len(parsed.ids) // BLOCK
        return full + parsed.sampling.n * (blocks_for(prompt + parsed.sampling.max_new_tokens) - full)

    def check_admissible(self, parsed: ParsedRequest) -> None:
        """Raise RequestError for a request that could never be admitted: more answers than
        rows, or more KV blocks than the whole pool (it would wait for ever)."""
        if parsed.sampling.n > self.max_batch:
            raise RequestError(f"n = {parsed.sampling.n} answers are decoded side by side, and this engine decodes "
                               f"at most {self.max_batch} rows together (--max-batch)", "n")
        need = self.blocks_needed(parsed) * self.pool.block_bytes
        budget = self.pool.blocks * self.pool.block_bytes
        if need > budget:
            raise RequestError(f"this request may need {need / 2**20:.0f} MB of KV cache ({len(parsed.ids)} prompt "
                               f"tokens and up to {parsed.sampling.max_new_tokens} more, for each of "
                               f"{parsed.sampling.n} answers), more than this engine's budget of "
                               f"{budget / 2**20:.0f} MB (--kv-cache-mb); lower max_tokens or n",
                               "max_tokens", "kv_cache_exceeded")

    def _admit(self) -> None:
        """Every waiting sequence that fits, in order (their images are encoded and prompts
        prefilled in this step and the next ones, a slice at a time). The next request waits
        (first come, first served) until it has a row for each of its n answers and the pool
        has blocks for its prompt (beyond a shared prefix) and one more for each generating row;
        one that could never fit (Engine.parse refuses those) fails at once."""
        while self._admit_next():
            pass

    def _admit_next(self) -> bool:
        """Admit (or fail) the first waiting sequence; False when it has to wait or none does."""
        with self.lock:
            if not self.waiting:
                return False
            seq = self.waiting[0]
        try:
            self.check_admissible(seq.parsed)
            shared = self._shared_prefix(seq)
            rows = seq.rows if seq.text is not None else seq.params.n
            taken = sum(1 for b in shared if self.pool.refs[b] == 0)  # leave the prefix cache when shared
            need = blocks_for(len(seq.parsed.ids) + len(seq.replay)) - len(shared)  # a preempted one replays too
            growing = sum(1 for s in self.running if not s.prefilling)
            if self._rows_used() + rows > self.max_batch or self.pool.available - taken < need + growing:
                return False
        except Exception as exc:  # it would wait for ever, or its spans failed: fail it now
            self._dequeue(seq)
            self._fail(seq, exc)
            return True
        self._dequeue(seq)
        try:
            self._start(seq, shared, need)
        except Exception as exc:  # one request's images, budget or cancellation: it alone fails
            self._release(seq)
            self._fail(seq, exc)
        return True

    def _dequeue(self, seq: Sequence) -> None:
        with self.lock:
            self.waiting.remove(seq)

    def _shared_prefix(self, seq: Sequence) -> list[int]:
        """The pool's blocks holding the longest prefix of its prompt (never its last token,
        which is always run to get logits): whole blocks, and with --deterministic whole
        prefill chunks only, as a fresh prefill computes them."""
        if not self.pool.enabled:
            return []
        if seq.digests is None:
            seq.spans = self.engine.spans(seq.parsed)
            seq.digests = block_hashes(seq.parsed.ids, seq.spans, (len(seq.parsed.ids) - 1) // BLOCK,
                                       salt=seq.parsed.cache_salt)
        shared = self.pool.lookup(seq.digests)
        if self.engine.options.deterministic:
            per_chunk = DETERMINISTIC_CHUNK // BLOCK
            shared = shared[: len(shared) // per_chunk * per_chunk]
        if self.states is not None:  # where a snapshot of the recurrent state is kept
            n = len(shared) // SNAPSHOT_BLOCKS * SNAPSHOT_BLOCKS
            while n and seq.digests[n - 1] not in self.pool.snapshots:
                n -= SNAPSHOT_BLOCKS
            shared = shared[:n]
        return shared

    def _start(self, seq: Sequence, shared: list[int], need: int) -> None:
        """Its blocks (the shared prefix's and new ones for the rest of its prompt) and, on its
        first admission, its sampling state; its images are encoded in later steps
        (`_prepare`). A preempted sequence keeps its text, generator and constraint state."""
        engine, params = self.engine, seq.params
        if seq.stop_reason:
            raise Cancelled(seq.stop_reason)
        first, seq.admitted = not seq.admitted, True
        if first:
            if seq.started is None:
                seq.started = time.perf_counter()
            if seq.on_start is not None:
                seq.on_start()
            seq.rows = params.n
        if not seq.spans:
            seq.spans = engine.spans(seq.parsed)
        if self.pool.enabled:
            self.pool.stats.hits += bool(shared)
            self.pool.stats.misses += not shared
        self.pool.share(shared)
        seq.blocks = shared + self.pool.allocate(need)
        seq.hashed = len(shared)
        if self.states is not None:
            seq.slot = self.states.allocate(self.pool.snapshot_after(seq.digests[len(shared) - 1]) if shared else None)
        seq.filled = reused = len(shared) * BLOCK
        if first:
            seq.timings.cached["prefix"], seq.timings.reused_tokens = reused > 0, reused
        seq.preparing = engine.prepare_steps(seq.parsed, seq.timings, reused, seq.cancel, seq.spans)
        if first and not seq.parsed.last_hidden:
            vocab = self.model.cfg.text.vocab_size
            if params.repetition_penalty != 1.0:
                seq.seen = torch.zeros(vocab, dtype=torch.bool)
                ids = seq.parsed.ids
                seq.seen[ids[ids < vocab]] = True
            if params.presence_penalty or params.frequency_penalty:
                seq.counts = torch.zeros(vocab)
            seq.generator = params.generator(seq.index)
            if params.constraint is not None:
                seq.guide = engine.grammars.guide(params.constraint)
            seq.text = self._text_stream(seq, seq.timings, seq.index)
        self.running.append(seq)

    def _text_stream(self, seq: Sequence, timings: Timings, index: int = 0) -> TextStream:
        """A row's text: its request's stop strings and EOS, and its reasoning kept apart when
        the prompt opened `<think>`."""
        engine, params = self.engine, seq.params
        usage = Usage(prompt_tokens=len(seq.parsed.ids), image_tokens=seq.parsed.image_tokens,
                      video_tokens=seq.parsed.video_tokens)
        return TextStream(engine.tokenizer, params.stop, engine.eos_ids(params), usage, timings, seq.started, index,
                          engine.think_end if seq.parsed.reasoning else None)

    def _view(self, seqs: list[Sequence]) -> KVCache:
        """The block tables of these sequences, one row each (-1 past a row's blocks), and
        their recurrent-state slots."""
        width = max(len(s.blocks) for s in seqs)
        table = torch.full((len(seqs), width), -1, dtype=torch.int64)
        for i, s in enumerate(seqs):
            table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int64)
        states = None if self.states is None else StateRows(self.states, torch.tensor([s.slot for s in seqs]))
        return KVCache(self.pool, table, states)

    def _prepare_and_prefill(self) -> None:
        """One slice of prompt work, oldest sequence first: about slice_s and its tokens while
        other rows generate, all of the oldest's when none do. What the slice's time has left
        goes to the next ones, so several short prompts that arrive together start in one step,
        not one per step (their first tokens no longer wait for each other's decode steps)."""
        started = time.perf_counter()
        generating = self.slice_s is not None and any(not s.prefilling for s in self.running)
        deadline = started + self.slice_s if generating else float("inf")
        tokens = self._slice_tokens() if generating else PREFILL_TOKENS_ALONE
        for i, seq in enumerate([s for s in self.running if s.prefilling]):
            if i > 0:  # an earlier sequence now waits for its first token: the rest of a slice only
                if self.slice_s is None or time.perf_counter() >= started + self.slice_s:
                    return
                deadline = started + self.slice_s
            if seq.preparing is not None:
                self._prepare(seq, deadline - time.perf_counter())
                if seq.preparing is not None or seq not in self.running or (i == 0 and generating):
                    return  # its vision goes on, it failed, or it took this step's slice
            if i > 0:  # the tokens the slice's remaining time allows, if worth a pass over the weights
                tokens = min(tokens, int(self.prefill_rate * (deadline - time.perf_counter())))
                if tokens < min(self._slice_floor(), len(seq.prompt) - seq.filled):
                    return
            filled = seq.filled
            self._prefill(seq, tokens)
            tokens -= seq.filled - filled
            if seq.prefilling:  # its prompt goes on in the next step (or it failed): the slice is spent
                return

    def _prepare(self, seq: Sequence, budget_s: float) -> None:
        """Vision blocks of one sequence for about `budget_s`, until its prompt is ready."""
        deadline = time.perf_counter() + budget_s
        try:
            while time.perf_counter() < deadline:
                next(seq.preparing)
        except StopIteration as stop:
            seq.preparing = None
            seq.prompt = stop.value
            seq.position = seq.prompt.next_position
        except Exception as exc:
            self._retire(seq, exc)

    def _slice_floor(self) -> int:
        """The fewest prompt tokens worth a prefill call while rows generate: MIN_SLICE_TOKENS,
        fewer where the measured rate says those would take longer than MAX_FLOOR_S (a CPU whose
        prefill is bound by its products, not by the pass over the weights each call makes)."""
        return max(LEAST_SLICE_TOKENS, min(MIN_SLICE_TOKENS, int(self.prefill_rate * MAX_FLOOR_S)))

    def _slice_tokens(self) -> int:
        """Prompt tokens for about slice_s at the measured prefill rate."""
        return int(min(PREFILL_TOKENS_ALONE, max(self._slice_floor(), self.prefill_rate * self.slice_s)))

    def _prefill(self, seq: Sequence, budget: int) -> None:
        """The next `budget` prompt tokens of one sequence; its first token's logits at the end."""
        try:
            if seq.cancel is not None and seq.cancel():
                raise Cancelled()
            end = min(len(seq.prompt), seq.filled + budget)
            started = time.perf_counter()
            if self.engine.options.deterministic:
                logits, end = self._prefill_aligned(seq, end)
            else:
                logits = self._prefill_call(seq, seq.filled, end)
            # short runs say little about the rate: each includes a pass over the weights, so
            # their rate would shrink the next slices and drift down (the warm-up's stands instead)
            if end - seq.filled >= MIN_SLICE_TOKENS:
                rate = (end - seq.filled) / max(time.perf_counter() - started, 1e-6)
                self.prefill_rate = 0.5 * self.prefill_rate + 0.5 * rate
            seq.filled = end
            self._register(seq, seq.digests or [])
            if end == len(seq.prompt) and seq.parsed.last_hidden:
                self._retire(seq, hidden=logits[0].float())
            elif end == len(seq.prompt):
                seq.logits = logits[0].float()
                self._fork(seq)
        except Exception as exc:
            self._retire(seq, exc)

    def _prefill_aligned(self, seq: Sequence, end: int) -> tuple[torch.Tensor, int]:
        """--deterministic: prompt tokens seq.filled (a chunk boundary) to about `end` as whole
        DETERMINISTIC_CHUNK-token chunks at fixed positions, one call each (at least one), so
        every token's keys, values and logits are computed in the same products whatever the
        slice sizes or the reused prefix were. Returns the last chunk's logits (or hidden state; None
        unless it ends the prompt) and the new end."""
        chunk, total = DETERMINISTIC_CHUNK, len(seq.prompt)
        end = min(total, max(end // chunk * chunk, seq.filled + chunk))
        logits = None
        for s in range(seq.filled, end, chunk):
            logits = self._prefill_call(seq, s, min(s + chunk, end))
        return logits, end

    def _prefill_call(self, seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """Prompt tokens start..end of one sequence in one model call (prefill_slice: the last
        token's logits, or its hidden state for a last_hidden request, when it ends the prompt); for a
        hybrid model, the recurrent states at the call's capture points (state_cache.
        capture_points) are kept in the prefix cache after the blocks they follow."""
        view, digests = self._view([seq]), seq.digests or []
        if self.states is not None and self.pool.enabled:
            points = [p for p in capture_points(start, end, self._last_turn(seq)) if p // BLOCK <= len(digests)]
            view.states.capture = tuple(points)
            view.states.captured = tuple(self.states.empty_snapshot() for _ in points)
        logits = prefill_slice(self.model, view, seq.prompt, start, end, seq.parsed.last_hidden)
        if view.states is not None and view.states.capture:
            self._register(seq, digests, view.states.capture[-1])
            for point, snapshot in zip(view.states.capture, view.states.captured):
                self.pool.keep_snapshot(digests[point // BLOCK - 1], snapshot)
        return logits

    def _last_turn(self, seq: Sequence) -> int | None:
        """Where the prompt's last message begins: the `<|im_start|>` before the generation
        prompt's own (None without two)."""
        starts = (seq.parsed.ids == self.turn_token).nonzero().flatten() if self.turn_token is not None else []
        return int(starts[-2]) if len(starts) >= 2 else None

    def _fork(self, seq: Sequence) -> None:
        """The request's other n-1 answers, once its prompt is prefilled: rows sharing its
        blocks (a shared block is copied before one writes into it), each with its own text
        and generator (`params.generator(index)`)."""
        if seq.rows == 1:
            return
        for index in range(1, seq.rows):
            timings = Timings(parse_ms=seq.timings.parse_ms, vision_ms=seq.timings.vision_ms,
                              cached=dict(seq.timings.cached), reused_tokens=seq.timings.reused_tokens)
            params = seq.params
            sibling = Sequence(seq.parsed, seq.emit, seq.cancel, seq.started, timings=timings, spans=seq.spans,
                               digests=seq.digests, prompt=seq.prompt, blocks=list(seq.blocks), hashed=seq.hashed,
                               filled=seq.filled, position=seq.position, logits=seq.logits, index=index,
                               parent=seq, seen=None if seq.seen is None else seq.seen.clone(),
                               counts=None if seq.counts is None else seq.counts.clone(),
                               generator=params.generator(index),
                               guide=None if seq.guide is None else self.engine.grammars.guide(params.constraint))
            sibling.text = self._text_stream(seq, timings, index)
            if self.states is not None:
                sibling.slot = self.states.allocate()
                self.states.copy(seq.slot, sibling.slot)
            self.pool.share(seq.blocks)  # once the sibling exists: nothing can fail between
            self.running.insert(self.running.index(seq) + index, sibling)
        seq.rows = 1

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self, seqs: list[Sequence]) -> None:
        """Sample each row's next token from its own logits and parameters (or take the next
        of the tokens it is replaying); retire the rows that finish; give each row that goes
        on a block for its next position (preempting the newest sequences if the pool is
        out); feed them through one decode step together."""
        fed: list[tuple[Sequence, int]] = []
        self.last_rows = len(seqs)
        self.tokens += sum(not s.replay for s in seqs)  # replayed tokens were counted the first time
        for seq in seqs:
            if seq.cancel is not None and seq.cancel():
                self._retire(seq, Cancelled())
                continue
            if seq.replay:
                fed.append((seq, seq.replay.pop(0)))
                continue
            try:
                token, logprob = self._sample(seq)
            except Exception as exc:  # its constraint failed: this row alone ends
                self._retire(seq, exc)
                continue
            delta = seq.text.push(token, logprob)
            if delta is not None:
                seq.emit(delta)
            if seq.guide is not None and seq.guide.complete:
                seq.text.complete()
            if seq.text.finished or len(seq.text.ids) >= seq.params.max_new_tokens:
                self._retire(seq)
            else:
                fed.append((seq, token))
        for seq, _ in list(fed):
            if seq in self.running:
                self._writable(seq)
        fed = [(s, t) for s, t in fed if s in self.running]
        if not fed:
            return
        rows = [s for s, _ in fed]
        slots = torch.tensor([s.filled for s in rows])
        positions = torch.tensor([s.position for s in rows])
        tokens = torch.tensor([t for _, t in fed])
        try:
            if self.engine.options.deterministic and not self.model.language_model.rows_independent():
                # torch's GEMMs (fp32/bf16 weights without qvl's kernels) round by the row count
                logits = torch.cat([decode_step(self.model, self._view([s]), tokens[i : i + 1], slots[i : i + 1],
                                                positions[i : i + 1]) for i, s in enumerate(rows)])
            else:
                logits = decode_step(self.model, self._view(rows), tokens, slots, positions)
            logits = logits.float()
        except Exception as exc:  # the step failed for every row in it
            for seq in rows:
                self._retire(seq, exc)
            return
        for i, seq in enumerate(rows):
            seq.logits = logits[i]
            seq.filled += 1
            seq.position += 1
            if self.states is not None and seq.filled % SNAPSHOT_INTERVAL == 0 and self._keeps_answers():
                seq.passed = self.states.snapshot(seq.slot)

    def _keeps_answers(self) -> bool:
        """Whether the blocks (and states) of answer tokens are kept for later prompts: decode
        steps compute them in other roundings than a prefill, so not with --deterministic."""
        return self.pool.enabled and not self.engine.options.deterministic

    def _writable(self, seq: Sequence) -> None:
        """A block of its own for its next position: a new one at a block boundary, a copy of
        a block it shares (its siblings' prompt end). When the pool has none, the newest
        sequences are preempted until it does (the row itself, if it is the newest)."""
        i = seq.filled // BLOCK
        if i < len(seq.blocks) and self.pool.refs[seq.blocks[i]] == 1:
            return
        while (got := self.pool.allocate(1)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return
        if i < len(seq.blocks):  # copy on write
            self.pool.copy_block(seq.blocks[i], got[0])
            self.pool.release([seq.blocks[i]])
            seq.blocks[i] = got[0]
        else:
            seq.blocks.append(got[0])

    def _preempt(self, seq: Sequence) -> None:
        """Take a running sequence back to the front of the queue, its blocks released (its
        prompt's full blocks stay as prefix cache while the pool does not need them). When
        admitted again it prefills its prompt anew and feeds the tokens it had generated
        through decode steps before sampling again: the same keys and values as before."""
        self.running.remove(seq)
        self._register(seq, seq.digests or [])
        self._release(seq)
        self.preemptions += 1
        seq.replay = list(seq.text.ids) if seq.text is not None else []
        seq.logits, seq.prompt, seq.preparing, seq.filled = None, None, None, 0
        with self.lock:
            self.waiting.appendleft(seq)

    def _register(self, seq: Sequence, digests: list[bytes], filled: int | None = None) -> None:
        """Offer its full blocks covered by `digests` (and filled: its first `filled` positions,
        by default all it has filled) for sharing; with --deterministic only those of whole
        prefill chunks (a prompt's last, shorter chunk is computed in other products than the
        same tokens inside a whole chunk)."""
        end = seq.filled if filled is None else filled
        if self.engine.options.deterministic:
            end = end // DETERMINISTIC_CHUNK * DETERMINISTIC_CHUNK
        upto = min(end // BLOCK, len(digests), len(seq.blocks))
        for i in range(seq.hashed, upto):
            self.pool.register(seq.blocks[i], digests[i])
        seq.hashed = max(seq.hashed, upto)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.hashed = [], 0
        if seq.slot is not None:
            self.states.release(seq.slot)
            seq.slot, seq.passed = None, None

    def _sample(self, seq: Sequence) -> tuple[int, TokenLogprob | None]:
        """This row's next token under its own parameters: penalties, logit_bias, min_tokens,
        its constraint's mask, then temperature / top-k / top-p / min-p with its own
        generator; and, when asked, the token's log-probability under the model (raw logits)
        with the best alternatives."""
        params, logits = seq.params, seq.logits[None]
        reasoning = seq.text.reasoning if seq.text.thinking else None
        if reasoning is not None and params.reasoning_budget is not None and reasoning.tokens >= params.reasoning_budget:
            logits = torch.full_like(logits, float("-inf"))  # the budget is spent: `</think>`, then the answer
            logits[0, reasoning.end_id] = 0.0
        if seq.seen is not None or seq.counts is not None:
            vocab = logits.shape[-1]
            seen = seq.seen[None] if seq.seen is not None else torch.zeros(1, vocab, dtype=torch.bool)
            counts = seq.counts[None] if seq.counts is not None else torch.zeros(1, vocab)
            logits = apply_penalties(logits, seen, counts, params)
        logits = apply_logit_bias(logits, params)
        if len(seq.text.ids) < params.min_tokens and seq.text.eos_ids:
            logits = logits.index_fill(-1, torch.tensor(seq.text.eos_ids), float("-inf"))
        guided = seq.guide is not None and reasoning is None  # the constraint holds the answer, not the reasoning
        if guided:
            masked = seq.guide.mask(logits.clone())
            if not torch.isfinite(masked).any():  # min_tokens kept out the only way to end: end
                masked = seq.guide.mask(seq.logits[None].clone())
            logits = masked
        token = int(sample(logits, params, None if seq.generator is None else [seq.generator])[0])
        if guided:
            seq.guide.advance(token)
        if seq.seen is not None:
            seq.seen[token] = True
        if seq.counts is not None:
            seq.counts[token] += 1
        if params.logprobs is None:
            return token, None
        return token, TokenLogprob(token, *top_logprobs(seq.logits, token, params.logprobs))

    # -- finishing --------------------------------------------------------------------------

    def _drop_stopped(self) -> None:
        for seq in [s for s in self.running if s.stop_reason]:
            self._retire(seq, Cancelled(seq.stop_reason))
        with self.lock:
            gone = [s for s in self.waiting if s.stop_reason]
            for seq in gone:
                self.waiting.remove(seq)
        for seq in gone:
            self._fail(seq, Cancelled(seq.stop_reason))

    def _retire(self, seq: Sequence, error: BaseException | None = None, hidden: torch.Tensor | None = None) -> None:
        """Take a running sequence out, its blocks released (the full ones of its prompt, and
        of the answer tokens fed back unless --deterministic, stay as prefix cache): its Done
        (the answer is kept for exact repeats; a last_hidden request's carries `hidden` [D]), or
        the error that ended it."""
        self.running.remove(seq)
        if error is None and self._keeps_answers():
            ids = torch.cat([seq.parsed.ids, torch.tensor(seq.fed_ids, dtype=torch.long)])
            digests = block_hashes(ids, seq.spans, seq.filled // BLOCK, seq.digests or [], seq.parsed.cache_salt)
            self._register(seq, digests)
            if seq.passed is not None:  # the state where this turn's last multiple of SNAPSHOT_INTERVAL was
                self.pool.keep_snapshot(digests[seq.filled // SNAPSHOT_INTERVAL * SNAPSHOT_BLOCKS - 1], seq.passed)
        else:
            self._register(seq, seq.digests or [])
        self._release(seq)
        if error is not None:
            self._fail(seq, error)
            return
        tail, done = seq.text.close() if hidden is None else (None, self._prefilled(seq, hidden))
        seq.done = True
        if tail is not None:
            seq.emit(tail)
        self.engine.remember(seq.parsed, done)
        seq.emit(done)

    @staticmethod
    def _prefilled(seq: Sequence, hidden: torch.Tensor) -> Done:
        """The Done of a request that ends after its prefill: no text, its hidden state [D]."""
        parsed, t = seq.parsed, seq.timings
        t.ttft_ms = (time.perf_counter() - seq.started) * 1000
        t.prefill_ms = max(0.0, t.ttft_ms - t.vision_ms - t.parse_ms)
        usage = Usage(prompt_tokens=len(parsed.ids), image_tokens=parsed.image_tokens, video_tokens=parsed.video_tokens)
        return Done("", [], "stop", usage, t, hidden=hidden)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        seq.done = True
        seq.emit(error)
