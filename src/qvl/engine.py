"""The engine: owns the model, tokenizer, processors and caches; turns a chat request
into a stream of events. Every front door (CLI, server, batch, bench) calls it."""

from __future__ import annotations

import importlib
import sys
import time
from collections import deque
from collections.abc import Generator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError

from qvl.cache import AnswerCache, ImageFeatures, VisionCache, image_spans
from qvl.config import GenerationDefaults, ModelConfig
from qvl.deadline import Deadline
from qvl.generate import CancelCheck, Cancelled, PreparedPrompt, check, decode_step, new_cache, prefill
from qvl.grammar import Grammars
from qvl.hub import resolve_model
from qvl.kernels.library import library
from qvl.kernels.plan import Plan
from qvl.model.rope import mrope_positions
from qvl.model.vision import run_steps
from qvl.paths import locked
from qvl.processing.image import ImageProcessorConfig, ProcessedImage
from qvl.processing.prompt import load_chat_template
from qvl.processing.tokenizer import Tokenizer
from qvl.quantize import WEIGHT_FORMATS, Int4Linear, Int8Linear, QuantSpec
from qvl.processing.video import MAX_VIDEOS, VIDEO_FRAMES_CAP, VIDEO_TOKENS_CAP, VideoSettings
from qvl.requests import ClipCache, Limits, ParsedRequest, Request, RequestError, parse_request
from qvl.retrieval.task import GENERATE, model_task, wrong_task
from qvl.runtime import RuntimeInfo, configure
from qvl.sampling import SamplingParams
from qvl.scheduler import DEFAULT_MAX_BATCH, Scheduler, Sequence
from qvl.stream import Delta, Done, Timings
from qvl.threads import Threads, machine_load, team_placement
from qvl.weights import (UNUSED_CACHE_DAYS, checkpoint_quantization, load_model, prune_quantized_cache,
                         quantized_cache_dir, write_streamed)

__all__ = ["Cancelled", "Engine", "EngineOptions", "ParsedRequest", "Request", "RequestError"]

VISION_GROUP_PATCHES = 4096  # images / frame pairs encoded in one vision pass, in patches (1024 tokens)
DEFAULT_MAX_IMAGE_TOKENS = 256  # CPU default budget per image (~512x512): docs/decisions/image-budget.md
DEFAULT_MAX_CONTEXT = 32768
DEFAULT_WEIGHTS = "int8"  # ~2x faster decoding than bf16 at near-identical outputs: docs/decisions/int8-weights.md


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = None  # folder or hub id; None = $QVL_MODEL or the default
    name: str | None = None  # what answers call the model (a server's alias for it); None: see Engine.model_name
    dtype: str = "auto"  # compute dtype of int8/int4 models; bf16/fp32 weights compute in their own
    weights: str = "auto"  # auto | bf16 | fp32 | int8 | int4 (auto: a pre-quantised file's format, else int8)
    group_size: int = 128  # int4 group size
    vision_int8: bool | None = None  # None: the tier decides (see kernels.plan.Plan.choose)
    int8_activations: str = "auto"  # auto | off | vision | all: which int8 layers run many rows int8 x int8
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS
    image_tokens_cap: int = 4096  # the most one request may raise the budget to (4 megapixels)
    max_images: int = 8
    max_context: int = DEFAULT_MAX_CONTEXT
    vision_cache_mb: float = 256
    prefix_cache_mb: float = 512  # of the KV pool, what blocks no request holds may keep for reuse
    answer_cache_entries: int = 256
    quant_cache: bool = True  # keep int8/int4 weights quantised at load for the next start
    max_batch: int = DEFAULT_MAX_BATCH  # requests decoded together (the scheduler's rows)
    kv_cache_mb: float | None = None  # the KV pool (running rows and prefix cache); None: see default_kv_budget_mb
    deterministic: bool = False  # answers independent of prefill slicing and prefix reuse too (see Scheduler)
    reasoning_budget: int | None = None  # Thinking models: reasoning tokens before </think> is forced (default)
    video: VideoSettings = VideoSettings()  # per clip: sampling fps, frame cap, token budget (defaults)
    video_tokens_cap: int = VIDEO_TOKENS_CAP  # the most one request may raise a clip's budget to
    video_frames_cap: int = VIDEO_FRAMES_CAP  # ... and its frame cap to
    max_videos: int = MAX_VIDEOS
    max_video_seconds: float | None = None  # longer clips are refused (None: any length)
    clip_cache_mb: float = 256  # decoded clips kept for follow-up questions


def _load_weights(path: Path, cfg: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None, prequantised: bool,
                  use_cache: bool, dequantise: bool = False):
    """Load the checkpoint. Quantising a bf16 checkpoint takes tens of seconds, so the result
    is kept (see weights.quantized_cache_dir) and later starts load it directly. `dequantise`:
    a pre-quantised int8 checkpoint loads as float values (see weights.load_model), uncached."""
    if quant is None or prequantised or not use_cache or dequantise:
        return load_model(path, cfg, dtype, quant, dequantise)
    cached = quantized_cache_dir(path, quant, dtype)
    with ExitStack() as stack:
        try:
            cached.mkdir(parents=True, exist_ok=True)
            stack.enter_context(locked(cached / ".lock"))  # a second process waits, then loads what the first wrote
        except OSError as exc:  # not even the temporary cache folder can be written: quantise every time
            print(f"qvl: cannot keep quantised weights in {cached}: {exc}", file=sys.stderr)
            return load_model(path, cfg, dtype, quant)
        model = None
        if any((cached / name).exists() for name in ("model.safetensors", "model.safetensors.index.json")):
            try:
                model = load_model(cached, cfg, dtype)
            except (ValueError, OSError, SafetensorError) as exc:  # damaged (a crash, a disk error): quantise again
                print(f"qvl: the quantised weights kept in {cached} are unreadable ({exc}); quantising again",
                      file=sys.stderr)
                for stale in cached.glob("model*.safetensors*"):
                    stale.unlink(missing_ok=True)
        if model is None:
            failed = None
            try:  # quantised tensor by tensor into the cache, then mapped from it like any later start
                write_streamed(path, cached, quant, dtype)
            except OSError as exc:  # a full disk costs only the next start
                failed = str(exc)  # the message only: the writer's buffers go with the traceback
            if failed is not None:
                print(f"qvl: could not keep the quantised weights in {cached}: {failed}", file=sys.stderr)
                return load_model(path, cfg, dtype, quant)
            model = load_model(cached, cfg, dtype)
    if removed := prune_quantized_cache(cached):
        print(f"qvl: removed {len(removed)} quantised-weights cache entries unused for {UNUSED_CACHE_DAYS} days "
              f"from {cached.parent}", file=sys.stderr)
    return model


def chosen_weights(requested: str, stored: QuantSpec | None) -> str:
    """The weight format a load uses: the one asked for, else a pre-quantised checkpoint's own,
    else int8."""
    return requested if requested != "auto" else (stored.weights if stored else DEFAULT_WEIGHTS)


def _weights_name(model) -> str:
    head = model.lm_head
    if isinstance(head, Int4Linear):
        return f"int4-g{head.group_size}"
    return "int8" if isinstance(head, Int8Linear) else str(model.dtype).replace("torch.", "")


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, template: str, image_cfg: ImageProcessorConfig,
                 defaults: GenerationDefaults, options: EngineOptions, runtime: RuntimeInfo, path: Path,
                 load_s: float, plan: Plan):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.plan = plan  # what runs each kind of layer (qvl.kernels.plan)
        self.image_cfg, self.defaults, self.options, self.runtime = image_cfg, defaults, options, runtime
        # qvl's kernels on all threads; torch's own ops on the cores other programs leave free (unless --threads)
        # (and while a core is busy, each thread on a core of its own: threads.Placement)
        self.threads = (Threads(runtime.threads, None) if options.threads else
                        Threads(runtime.threads, machine_load(), team_placement(runtime.threads)))
        self.path, self.load_s = path, load_s
        self.weights = _weights_name(model)
        self.limits = Limits(options.max_image_tokens, max(options.image_tokens_cap, options.max_image_tokens),
                             options.max_images, options.max_context, options.video,
                             max(options.video_tokens_cap, options.video.max_tokens),
                             max(options.video_frames_cap, options.video.max_frames), options.max_videos,
                             options.max_video_seconds)
        self.clips = ClipCache(options.clip_cache_mb)
        self.vision_cache = VisionCache(options.vision_cache_mb)
        self.answer_cache = AnswerCache(options.answer_cache_entries)
        self.scheduler = Scheduler(self, options.max_batch, options.kv_cache_mb, options.prefix_cache_mb)
        self.grammars = Grammars(tokenizer, model.cfg.text.vocab_size, defaults.eos_token_ids)
        self.think_end = tokenizer.find("</think>")  # a Thinking model's reasoning ends there
        self.task = model_task(path, options.model)  # generate | embed | rerank: what its checkpoint is for
        self._thinks: dict[bool | None, bool] = {}  # thinks(enable_thinking), rendered once each

    @classmethod
    def load(cls, options: EngineOptions = EngineOptions()) -> Engine:
        started = time.perf_counter()
        path = resolve_model(options.model)
        cfg = ModelConfig.from_file(path / "config.json")
        stored = checkpoint_quantization(path)
        dequantise = stored is not None and options.weights not in ("auto", stored.weights)
        if dequantise:  # an int8 checkpoint's values, as float weights (then quantised as asked)
            if stored.weights != "int8":
                raise ValueError(f"{path} holds pre-quantised {stored.weights} weights; run it with --weights "
                                 f"{stored.weights} (or auto), or use the original bf16 checkpoint for "
                                 f"{options.weights}")
            stored = None
        weights = chosen_weights(options.weights, stored)
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weights format '{weights}' (choose from auto, {', '.join(WEIGHT_FORMATS)})")
        dtype = weights if weights in ("bf16", "fp32") else options.dtype
        runtime = configure(dtype, options.threads, list(options.cpus) if options.cpus else None)
        # the kernels are built for this CPU on the first start (a few seconds), then loaded from the cache
        plan = Plan.choose(library(), runtime.dtype, weights, options.int8_activations, options.vision_int8,
                           stored.vision if stored else None)
        quant = (stored or QuantSpec(weights, options.group_size, plan.vision_int8)) if weights in ("int8", "int4") \
            else None
        gen_path = path / "generation_config.json"
        defaults = GenerationDefaults.from_file(gen_path) if gen_path.exists() else GenerationDefaults((151645,))
        model = _load_weights(path, cfg, runtime.dtype, quant, stored is not None, options.quant_cache, dequantise)
        plan.apply(model)
        tokenizer = Tokenizer.from_dir(path)
        image_cfg = ImageProcessorConfig.from_file(path / "preprocessor_config.json")
        template = load_chat_template(path)
        return cls(model, tokenizer, template, image_cfg, defaults, options, runtime, path,
                   time.perf_counter() - started, plan)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def int8_activations(self) -> str:
        """Which int8 layers run many rows int8 x int8: off | vision | all (the plan's)."""
        return self.plan.activations

    @property
    def model_name(self) -> str:
        """The name it was given (options.name), else the hub id, or the folder's name for a
        local checkpoint."""
        if self.options.name:
            return self.options.name
        name = self.options.model
        return name if name and not Path(name).expanduser().is_dir() else self.path.name

    @property
    def model_id(self) -> str:
        """Identifies what computes the answers: checkpoint, weight format, dtype."""
        vision = "|vision-int8" if isinstance(self.model.visual.blocks[0].attn.qkv, Int8Linear) else ""
        activations = "" if self.int8_activations == "off" else f"|int8-activations-{self.int8_activations}"
        if activations and self.plan.int8_code_bits == 7:
            activations += "-7bit"  # plain AVX2: the byte kernel's codes per group, or oneDNN's per token
        return f"{self.path.resolve()}|{self.weights}|{self.model.dtype}{vision}{activations}"

    def thinks(self, enable_thinking: bool | None = None) -> bool:
        """Whether the chat template opens `<think>` for the answer: a Thinking variant's always,
        a hybrid one's (Qwen3.5) as its switch `enable_thinking` says (None: the template's
        default). A request's own prompt decides its answer (ParsedRequest.reasoning)."""
        if self.task != GENERATE:
            return False
        if enable_thinking not in self._thinks:
            switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
            probe = Request([{"role": "user", "content": "?"}], template_kwargs=switch)
            self._thinks[enable_thinking] = self.parse(probe).reasoning
        return self._thinks[enable_thinking]

    @property
    def thinking_switch(self) -> bool:
        """The chat template turns thinking on and off with `enable_thinking`."""
        return self.thinks(True) != self.thinks(False)

    def sampling_defaults(self, **overrides) -> SamplingParams:
        """The checkpoint's generation_config defaults, with explicit overrides (None = keep)."""
        d = self.defaults
        base = SamplingParams(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                              repetition_penalty=d.repetition_penalty, max_new_tokens=d.max_new_tokens,
                              reasoning_budget=self.options.reasoning_budget)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def parse(self, request: Request, deadline: Deadline | None = None, task: str = GENERATE) -> ParsedRequest:
        """Decode images and videos, tokenize, check the budget: cheap next to generation, and
        raises RequestError / ImageError for anything unusable (a server answers 400 before
        queueing). `deadline` bounds the decoding and tokenizing (its time limit is a
        RequestError naming the part that took too long; cancelling it raises Cancelled).
        `task` is what the request wants of the model (generate, embed, rerank): another than
        its checkpoint's is a RequestError; embed and rerank requests end after their prefill."""
        if task != self.task:
            raise wrong_task(self.model_name, self.task, task)
        parsed = parse_request(request, self.tokenizer, self.template, self.image_cfg, self.limits, self.clips,
                               deadline)
        parsed.last_hidden = task != GENERATE
        self.scheduler.check_admissible(parsed)
        if parsed.sampling.constraint is not None:
            self.grammars.compile(parsed.sampling.constraint)  # a grammar it cannot enforce: RequestError
        return parsed

    # -- vision and prompt layout ---------------------------------------------------------

    def _features(self, units: list[ProcessedImage], salt: str, timings: Timings,
                  use_cache: bool = True) -> Generator[None, None, list[ImageFeatures]]:
        """The units' features (images, video frame pairs), through the vision cache (within
        the cache salt's namespace); those it misses are encoded together, up to
        VISION_GROUP_PATCHES patches per pass (a clip's small frame pairs fill the matrix
        products as one image would). Yields between vision blocks."""
        found = {u.content_hash: f for u in units if use_cache and (f := self.vision_cache.find(salt, u.content_hash))}
        missing = list({u.content_hash: u for u in units if u.content_hash not in found}.values())
        groups: list[list[ProcessedImage]] = []
        filled = 0  # patches in the last group
        for unit in missing:
            patches = unit.num_tokens * self.image_cfg.merge_size**2
            if not groups or filled + patches > VISION_GROUP_PATCHES:
                groups.append([])
                filled = 0
            groups[-1].append(unit)
            filled += patches
        for group in groups:
            timings.cached["vision"] = False
            pixels = torch.cat([u.pixel_values for u in group])
            embeds, deepstack = yield from self.model.visual.steps(pixels, [u.grid_thw for u in group])
            sizes = [u.num_tokens for u in group]
            per_unit = zip(embeds.split(sizes), *(d.split(sizes) for d in deepstack))
            for unit, (unit_embeds, *unit_deepstack) in zip(group, per_unit):
                found[unit.content_hash] = features = ImageFeatures(  # copies: the cache counts what it holds
                    unit_embeds.clone(), [d.clone() for d in unit_deepstack])
                if use_cache:
                    self.vision_cache.add(salt, unit.content_hash, features)
        return [found[u.content_hash] for u in units]

    def spans(self, parsed: ParsedRequest) -> list[tuple[int, int, str]]:
        """(start, end, content hash) of each image's tokens in the prompt."""
        return image_spans(self.cfg.is_vision_token(parsed.ids), parsed.image_hashes)

    def prepare(self, parsed: ParsedRequest, timings: Timings, skip: int = 0, cancel: CancelCheck | None = None,
                spans: list | None = None, use_cache: bool = True) -> PreparedPrompt:
        """Encode the images not already inside a reused prefix of `skip` tokens (through
        the vision cache, unless not `use_cache`) and lay out the M-RoPE positions."""
        with torch.inference_mode():
            return run_steps(self.prepare_steps(parsed, timings, skip, cancel, spans, use_cache))

    def prepare_steps(self, parsed: ParsedRequest, timings: Timings, skip: int = 0,
                      cancel: CancelCheck | None = None, spans: list | None = None,
                      use_cache: bool = True) -> Generator[None, None, PreparedPrompt]:
        """`prepare` in steps: yields between vision blocks (the scheduler decodes other rows
        there), returns the prompt. timings.vision_ms counts the time spent in it only."""
        spent, resumed = 0.0, time.perf_counter()
        spans = self.spans(parsed) if spans is None else spans
        needed = [(im, span) for im, span in zip(parsed.images, spans) if span[1] > skip]
        embeds_from = parsed.vision_tokens - sum(im.num_tokens for im, _ in needed)
        embeds = deepstack = None
        if needed:
            timings.cached["vision"] = True  # until an image misses
            encoding = self._features([im for im, _ in needed], parsed.cache_salt, timings, use_cache)
            while True:
                check(cancel)
                try:
                    next(encoding)
                except StopIteration as stop:
                    feats = stop.value
                    break
                spent += time.perf_counter() - resumed
                yield
                resumed = time.perf_counter()
            embeds = torch.cat([f.embeds for f in feats])
            deepstack = [torch.cat(layer) for layer in zip(*(f.deepstack for f in feats))]
        timings.vision_ms = (spent + time.perf_counter() - resumed) * 1000
        grids = [im.grid_thw for im in parsed.images]
        positions, next_position = mrope_positions(parsed.ids, grids, self.cfg.is_vision_token(parsed.ids),
                                                   self.cfg.vision.spatial_merge_size)
        return PreparedPrompt(parsed.ids, positions, next_position, embeds, deepstack, embeds_from)

    def close(self) -> None:
        """Done with it (a server unloading it): the scheduler lets go of the engine, so that the
        engine and its weights are freed as soon as their last holder lets go, without waiting
        for the garbage collector (which a server tells to skip what is alive at start). It
        runs no request after; its pinned threads may run anywhere again."""
        self.threads.rest()
        self.scheduler.engine = None

    def warm_up(self) -> float:
        """A small image and two tokens through vision, prefill and decode, past the caches
        (nothing is stored): the first real request then skips the first-touch page faults of
        the memory-mapped weights and oneDNN's first-use setup (~1 s of a 1920x1080 photo's
        first answer on the 2B model); the prefill rate the scheduler sizes its first slices by;
        the grammar engine's tokenizer index, so the first constrained request does not wait for
        it; and the video decoder's libraries. Returns the seconds it took."""
        from PIL import Image

        started = time.perf_counter()
        parsed = self.parse(Request([{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 64))},
                                                                  {"type": "text", "text": "Hi"}]}]), task=self.task)
        prompt = self.prepare(parsed, Timings(), use_cache=False)
        cache = new_cache(self.model, 1, len(prompt) + 1)
        logits = prefill(self.model, cache, prompt)
        decode_step(self.model, cache, logits.argmax(-1), torch.tensor([len(prompt)]),
                    torch.tensor([prompt.next_position]))
        # the prompt once more, timed (its pages now resident): the scheduler's first prefill
        # slices follow this rate until slices measure it; a short prompt's rate includes its
        # pass over the weights, so it errs low and the first slices short (a running stream's
        # worst gap while a photo is admitted: 1.3 s on plain AVX2 with the initial guess)
        timed = time.perf_counter()
        prefill(self.model, new_cache(self.model, 1, len(prompt) + 1), prompt)
        self.scheduler.prefill_rate = len(prompt) / max(time.perf_counter() - timed, 1e-6)
        self.grammars.warm_up()
        importlib.import_module("av")  # the video decoder's libraries load here, not in the first clip's answer

        return time.perf_counter() - started

    # -- generation ----------------------------------------------------------------------

    def eos_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return () if params.ignore_eos else self.defaults.eos_token_ids

    def _answer_key(self, parsed: ParsedRequest) -> str | None:
        if not (self.answer_cache.enabled and parsed.sampling.deterministic) or parsed.sampling.n > 1 \
                or parsed.last_hidden:
            return None
        return AnswerCache.key(self.model_id, parsed.ids, parsed.image_hashes, parsed.sampling, parsed.cache_salt)

    def cached_answer(self, request: Request | ParsedRequest) -> Done | None:
        """The stored answer of an exact repeat of a deterministic request, if any."""
        parsed = request if isinstance(request, ParsedRequest) else self.parse(request)
        key = None if parsed.answer_checked else self._answer_key(parsed)
        done = self.answer_cache.get(key) if key else None
        parsed.answer_checked = True
        if done is None:
            return None
        timings = Timings(cached={"answer": True})
        return Done(done.text, list(done.token_ids), done.finish_reason, replace(done.usage), timings, done.logprobs,
                    reasoning=done.reasoning)

    def stream(self, request: Request | ParsedRequest, cancel: CancelCheck | None = None) -> Iterator[Delta | Done]:
        """Events for one request: Delta pieces of text, then Done (for n answers: each event
        carries its answer's `index`, and the stream ends after the n-th Done). The caller's
        thread drives the scheduler (and with it whatever else it runs). Closing the iterator
        stops the request before its next step; so does `cancel()` turning true (checked
        between images, prefill slices and decode steps; raises Cancelled)."""
        started = time.perf_counter()
        parsed = request if isinstance(request, ParsedRequest) else self.parse(request)
        parse_ms = 0.0 if parsed is request else (time.perf_counter() - started) * 1000
        if (hit := self.cached_answer(parsed)) is not None:
            hit.timings.ttft_ms = (time.perf_counter() - started) * 1000
            if hit.text or hit.reasoning:
                yield Delta(hit.text, hit.token_ids, hit.logprobs, reasoning=hit.reasoning or "")
            yield hit
            return
        events: deque = deque()
        seq = Sequence(parsed, events.append, cancel, started, timings=Timings(parse_ms=parse_ms))
        self.scheduler.submit(seq)
        answers = 0
        try:
            while True:
                while not events:
                    self.scheduler.step()
                event = events.popleft()
                if isinstance(event, BaseException):
                    raise event
                yield event
                answers += isinstance(event, Done)
                if answers == parsed.sampling.n:
                    return
        finally:
            if not seq.done:  # closed early: take it out now, nobody may step again
                self.scheduler.stop(seq)
                self.scheduler.step()

    @property
    def prefix_cache(self):
        """The KV pool, whose unused full blocks are the prefix cache (its `stats`)."""
        return self.scheduler.pool

    def remember(self, parsed: ParsedRequest, done: Done) -> None:
        """Keep a finished request's answer for exact repeats."""
        key = self._answer_key(parsed)
        if key:
            self.answer_cache.put(key, done)

    def generate(self, request: Request | ParsedRequest) -> Done:
        """The final event of `stream` (of the first answer, for n > 1: see `stream`)."""
        dones = [event for event in self.stream(request) if isinstance(event, Done)]
        if not dones:
            raise RuntimeError("generation ended without a final event")
        return min(dones, key=lambda d: d.index)

    def generate_batch(self, requests: list[Request | ParsedRequest]) -> list[Done | Exception]:
        """Answer several requests together: exact repeats from the answer cache, the rest
        through the scheduler at once (each with its own sampling; rows decoded together and
        retired as each finishes). A request that fails gets its exception in its place."""
        parsed = [r if isinstance(r, ParsedRequest) else self.parse(r) for r in requests]
        if any(p.sampling.n > 1 for p in parsed):
            raise ValueError("generate_batch gives one answer per request: use stream() for n > 1")
        results: list[Done | Exception | None] = [self.cached_answer(p) for p in parsed]
        finished: dict[int, Done | Exception] = {}
        for i, p in enumerate(parsed):
            if results[i] is None:
                self.scheduler.submit(Sequence(p, lambda e, i=i: self._collect(finished, i, e)))
        while len(finished) < sum(r is None for r in results):
            self.scheduler.step()
        return [finished[i] if r is None else r for i, r in enumerate(results)]

    @staticmethod
    def _collect(finished: dict, i: int, event) -> None:
        if isinstance(event, (Done, BaseException)):
            finished[i] = event
