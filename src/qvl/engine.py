"""The engine: owns the model, tokenizer, processors and caches; turns a chat request
into a stream of events. Every front door (CLI, server, batch, bench) calls it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from qvl.config import GenerationDefaults, ModelConfig
from qvl.generate import PreparedPrompt, generate_step
from qvl.hub import resolve_model
from qvl.model.rope import mrope_positions
from qvl.processing.image import ImageProcessorConfig, ProcessedImage, load_image, preprocess
from qvl.processing.prompt import load_chat_template, tokenize_chat
from qvl.processing.tokenizer import Tokenizer
from qvl.runtime import RuntimeInfo, configure
from qvl.sampling import SamplingParams
from qvl.stream import Delta, Done, Timings, Usage, stream_text
from qvl.quantize import WEIGHT_FORMATS, Int4Linear, Int8Linear, QuantSpec
from qvl.weights import checkpoint_quantization, load_model

DEFAULT_MAX_IMAGE_TOKENS = 1024  # CPU default budget per image; see docs/benchmarks.md
DEFAULT_MAX_CONTEXT = 32768
DEFAULT_WEIGHTS = "int8"  # ~2x faster decoding than bf16 at near-identical outputs; see docs/benchmarks.md


def _model_quant(model) -> QuantSpec | None:
    head = model.lm_head
    if isinstance(head, Int4Linear):
        return QuantSpec("int4", head.group_size)
    return QuantSpec("int8") if isinstance(head, Int8Linear) else None


class RequestError(ValueError):
    """A request qvl cannot serve as given; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = None  # folder or hub id; None = $QVL_MODEL or the default
    dtype: str = "auto"  # compute dtype of int8/int4 models; bf16/fp32 weights compute in their own
    weights: str = "auto"  # auto | bf16 | fp32 | int8 | int4 (auto: a pre-quantised file's format, else int8)
    group_size: int = 128  # int4 group size
    vision_int8: bool = False
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS
    max_images: int = 8
    max_context: int = DEFAULT_MAX_CONTEXT


@dataclass
class Request:
    """messages: [{"role", "content": str | [{"type": "text", "text"} | {"type": "image",
    "image": path | bytes | PIL.Image}]}]; max_image_tokens overrides the engine budget."""

    messages: list[dict]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_image_tokens: int | None = None


@dataclass
class ParsedRequest:
    """A request checked and tokenized; images decoded and preprocessed, not yet encoded."""

    ids: torch.Tensor  # [T] long, image placeholders expanded
    images: list[ProcessedImage]
    sampling: SamplingParams

    @property
    def image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, template: str, image_cfg: ImageProcessorConfig,
                 defaults: GenerationDefaults, options: EngineOptions, runtime: RuntimeInfo, path: Path,
                 load_s: float):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.image_cfg, self.defaults, self.options, self.runtime = image_cfg, defaults, options, runtime
        self.path, self.load_s = path, load_s
        self.weights = quant.weights if (quant := _model_quant(model)) else str(model.dtype).replace("torch.", "")

    @classmethod
    def load(cls, options: EngineOptions = EngineOptions()) -> Engine:
        started = time.perf_counter()
        path = resolve_model(options.model)
        cfg = ModelConfig.from_file(path / "config.json")
        stored = checkpoint_quantization(path)
        weights = options.weights if options.weights != "auto" else (stored.weights if stored else DEFAULT_WEIGHTS)
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weights format '{weights}' (choose from auto, {', '.join(WEIGHT_FORMATS)})")
        dtype = weights if weights in ("bf16", "fp32") else options.dtype
        runtime = configure(dtype, options.threads, list(options.cpus) if options.cpus else None)
        quant = None
        if weights in ("int8", "int4"):
            quant = stored or QuantSpec(weights, options.group_size, options.vision_int8)
        gen_path = path / "generation_config.json"
        defaults = GenerationDefaults.from_file(gen_path) if gen_path.exists() else GenerationDefaults((151645,))
        model = load_model(path, cfg, runtime.dtype, quant)
        tokenizer = Tokenizer.from_dir(path)
        image_cfg = ImageProcessorConfig.from_file(path / "preprocessor_config.json")
        template = load_chat_template(path)
        return cls(model, tokenizer, template, image_cfg, defaults, options, runtime, path,
                   time.perf_counter() - started)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def model_name(self) -> str:
        return self.options.model or self.path.name

    def sampling_defaults(self, **overrides) -> SamplingParams:
        """The checkpoint's generation_config defaults, with explicit overrides (None = keep)."""
        d = self.defaults
        base = SamplingParams(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                              repetition_penalty=d.repetition_penalty, max_new_tokens=d.max_new_tokens)
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    # -- request preparation -------------------------------------------------------------

    def _images(self, request: Request) -> tuple[list[dict], list[ProcessedImage]]:
        """Decode and preprocess every image part; returns template-ready messages."""
        tokens = request.max_image_tokens or self.options.max_image_tokens
        if tokens < 1:
            raise RequestError("max_image_tokens must be >= 1", "max_image_tokens")
        max_pixels = tokens * self.image_cfg.factor**2
        messages, images = [], []
        for message in request.messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        if len(images) >= self.options.max_images:
                            raise RequestError(f"too many images: at most {self.options.max_images} per request",
                                               "messages")
                        image = load_image(part["image"])
                        images.append(preprocess(image, self.image_cfg, max_pixels=max(max_pixels,
                                                                                       self.image_cfg.factor**2)))
                        parts.append({"type": "image"})
                    else:
                        parts.append(part)
                content = parts
            messages.append({**message, "content": content})
        return messages, images

    def _encode_images(self, images: list[ProcessedImage]) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        if not images:
            return None, None
        with torch.inference_mode():
            outs = [self.model.encode_images(im.pixel_values, [im.grid_thw]) for im in images]
        embeds = torch.cat([o[0] for o in outs])
        deepstack = [torch.cat(layer) for layer in zip(*(o[1] for o in outs))]
        return embeds, deepstack

    def parse(self, request: Request) -> ParsedRequest:
        """Decode images, render and tokenize the conversation, check the budget. Cheap next
        to generation, and raises RequestError / ImageError for anything unusable, so a
        server can answer 400 before it queues the request."""
        messages, images = self._images(request)
        if not messages:
            raise RequestError("messages must not be empty", "messages")
        counts = [im.num_tokens for im in images]
        tokens = tokenize_chat(self.tokenizer, self.template, messages, counts)
        ids = torch.tensor(tokens.ids, dtype=torch.long)
        limit = self.options.max_context
        if len(ids) + request.sampling.max_new_tokens > limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens and asks for up to {request.sampling.max_new_tokens} more, "
                f"but the context holds {limit}; shorten the conversation, lower max_tokens or the image budget",
                "messages", "context_length_exceeded")
        return ParsedRequest(ids, images, request.sampling)

    def prepare(self, parsed: ParsedRequest, timings: Timings) -> PreparedPrompt:
        """Encode the images and lay out the M-RoPE positions."""
        started = time.perf_counter()
        embeds, deepstack = self._encode_images(parsed.images)
        timings.vision_ms = (time.perf_counter() - started) * 1000
        grids = [im.grid_thw for im in parsed.images]
        positions, next_position = mrope_positions(parsed.ids, grids, self.cfg.image_token_id,
                                                   self.cfg.vision.spatial_merge_size)
        return PreparedPrompt(parsed.ids, positions, next_position, embeds, deepstack)

    # -- generation ----------------------------------------------------------------------

    def eos_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return () if params.ignore_eos else self.defaults.eos_token_ids

    def stream(self, request: Request | ParsedRequest) -> Iterator[Delta | Done]:
        """Events for one request: Delta pieces of text, then Done. Closing the iterator
        cancels the generation before the next decode step."""
        started = time.perf_counter()
        parsed = request if isinstance(request, ParsedRequest) else self.parse(request)
        timings = Timings()
        prompt = self.prepare(parsed, timings)
        usage = Usage(prompt_tokens=len(parsed.ids), image_tokens=parsed.image_tokens)
        params = parsed.sampling
        eos = self.eos_ids(params)
        steps = (row[0] for row in generate_step(self.model, [prompt], params, eos))
        yield from stream_text(steps, self.tokenizer, params.stop, eos, usage, timings, started)

    def generate(self, request: Request | ParsedRequest) -> Done:
        """The final event of `stream`."""
        for event in self.stream(request):
            if isinstance(event, Done):
                return event
        raise RuntimeError("generation ended without a final event")

    def generate_batch(self, requests: list[Request | ParsedRequest]) -> list[Done]:
        """Answer several requests with one batched decode: images encoded and prompts
        prefilled one by one, then all rows decoded together (a decode step reads the
        weights once for every row). All requests must share sampling parameters."""
        parsed = [r if isinstance(r, ParsedRequest) else self.parse(r) for r in requests]
        params = parsed[0].sampling
        if any(p.sampling != params for p in parsed):
            raise ValueError("a batch needs the same sampling parameters for every request")
        started = time.perf_counter()
        timings = [Timings() for _ in parsed]
        prompts = [self.prepare(p, t) for p, t in zip(parsed, timings)]
        eos = self.eos_ids(params)
        rows: list[list[int]] = [[] for _ in parsed]
        step_ms, last = [], None
        for step in generate_step(self.model, prompts, params, eos):
            now = time.perf_counter()
            step_ms.append((now - (last or started)) * 1000)
            last = now
            for row, token in zip(rows, step):
                if token is not None:
                    row.append(token)
        results = []
        for p, t, row in zip(parsed, timings, rows):
            usage = Usage(prompt_tokens=len(p.ids), image_tokens=p.image_tokens)
            *_, done = stream_text(iter(row), self.tokenizer, params.stop, eos, usage, t, started)
            # stream_text timed a replay; the batch's own clock is what happened
            done.timings.ttft_ms = step_ms[0]
            done.timings.prefill_ms = max(0.0, step_ms[0] - sum(x.vision_ms for x in timings)) / len(parsed)
            done.timings.decode_ms = step_ms[1 : len(row)]
            done.timings.decode_ms_per_token = sum(done.timings.decode_ms) / max(1, len(done.timings.decode_ms))
            results.append(done)
        return results
