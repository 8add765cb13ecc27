"""The options every front door shares (ask, chat, serve, batch, bench): the engine flags, the
sampling flags and the answer's constraint, each registered on a parser (`add_*_args`) and read
back from its namespace into a picklable dataclass. Nothing here loads a model."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qvl.engine import Engine, EngineOptions
    from qvl.grammar import Constraint
    from qvl.sampling import SamplingParams


class UsageError(ValueError):
    """The flags or files as given cannot work (bad INPUT, duplicate ids, no prompt, an
    unreadable --json-schema): exit status 2."""


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """several_models: --model may be repeated (`qvl serve`), each optionally NAME=MODEL; the
    list is args.models and args.model is not set."""
    from qvl.processing.video import DEFAULT_FPS, DEFAULT_MAX_FRAMES, DEFAULT_MAX_VIDEO_TOKENS, VIDEO_TOKENS_CAP

    g = p.add_argument_group("engine")
    model_help = "model folder, Hugging Face id or short name (default: $QVL_MODEL or Qwen/Qwen3-VL-2B-Instruct)"
    if several_models:
        g.add_argument("--model", "-m", action="append", dest="models", metavar="[NAME=]MODEL",
                       help=model_help.replace(" (default", "; repeat to serve several, each called NAME if "
                                                           "given, else by its folder name or hub id (default"))
    else:
        g.add_argument("--model", "-m", help=model_help)
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="compute dtype of int8/int4 models; auto = bf16 where the CPU has AVX512-BF16/AMX, else fp32")
    g.add_argument("--weights", default="auto", choices=["auto", "bf16", "fp32", "int8", "int4"],
                   help="weight format; auto = a pre-quantised checkpoint's own, else int8 (quantised at load)")
    g.add_argument("--group-size", type=int, default=128, help="int4 group size (32, 64, 128, 256)")
    g.add_argument("--vision-int8", action=argparse.BooleanOptionalAction, default=None,
                   help="quantise the vision tower to int8 too (default: where compute is float32 or its "
                        "products run int8 x int8; see `qvl info`)")
    g.add_argument("--int8-activations", nargs="?", const="all", default="auto",
                   choices=["auto", "off", "vision", "all"],
                   help="which int8/int4 layers run their many-row products on integer activation codes: "
                        "auto = the vision tower and prefill where the byte kernel codes activations in 8 bits "
                        "(VNNI, ARM dot products) and for int4 weights, the vision tower only where it codes in "
                        "7 bits (plain AVX2), else off (`qvl info` prints the choice); all (the bare flag): both "
                        "everywhere, a faster first token, slightly less exact; off: float activations")
    g.add_argument("--threads", type=int, help="threads of qvl's kernels and torch's (default: physical cores, torch's "
                   "own ops then on the cores other programs leave free)")
    g.add_argument("--cpus", help="pin to these CPUs, e.g. 0-3,6 (sched_setaffinity, no root needed)")
    g.add_argument("--vision-cache-mb", type=float, default=256, help="image-feature cache budget (0 disables)")
    g.add_argument("--prefix-cache-mb", type=float, default=512, help="of the KV pool, what finished requests' blocks may keep for reuse by prompts "
                        "that begin the same way (0 disables)")
    g.add_argument("--answer-cache", type=int, default=256, help="answers kept for exact repeats (0 disables)")
    g.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together, each with its own sampling (serve, batch); more wait")
    g.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="Thinking models: after N reasoning tokens </think> is forced, so an answer always comes "
                        "(the default of every request; an API request may set its own)")
    g.add_argument("--deterministic", action="store_true",
                   help="answers that do not depend on prefill slicing or prefix reuse either (prefill in fixed "
                        "128-token chunks, only prompt keys/values reused): slower first tokens")
    g.add_argument("--kv-cache-mb", type=float,
                   help="the KV pool, in blocks of 16 positions: running rows take blocks as they grow; "
                        "when it is full new requests wait and the newest running one is recomputed later "
                        "(default: half the memory available after loading, at most 8192)")
    g.add_argument("--image-tokens-cap", type=int, default=4096,
                   help="the largest image budget a request may ask for (default 4096 tokens, 4 megapixels)")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--max-image-tokens", type=int, help="image budget per image, in LLM tokens")
    budget.add_argument("--max-pixels", type=int, help="image budget per image, in pixels (32x32 pixels per token)")
    v = p.add_argument_group("video (frames are sampled, resized and paired as Qwen3-VL's video processor does)")
    v.add_argument("--fps", type=float, default=DEFAULT_FPS, help="frames sampled per second of clip (default 2)")
    v.add_argument("--max-frames", type=int, default=DEFAULT_MAX_FRAMES,
                   help=f"frames per clip at most, spread evenly over longer clips (default {DEFAULT_MAX_FRAMES})")
    v.add_argument("--max-video-tokens", type=int, default=DEFAULT_MAX_VIDEO_TOKENS,
                   help="token budget of a whole clip: frames shrink to fit it (default "
                        f"{DEFAULT_MAX_VIDEO_TOKENS}, ~12 s to the first token on 2 cores for the 2B model)")
    v.add_argument("--video-tokens-cap", type=int, default=VIDEO_TOKENS_CAP,
                   help=f"the largest clip budget a request may ask for (default {VIDEO_TOKENS_CAP})")
    v.add_argument("--max-video-seconds", type=float, help="refuse longer clips (default: any length)")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The flags of `add_engine_args` as EngineOptions; a --task with a budget of its own sets
    the image budget when neither --max-image-tokens nor --max-pixels does."""
    from qvl.engine import DEFAULT_MAX_IMAGE_TOKENS, EngineOptions
    from qvl.processing.video import VideoSettings
    from qvl.runtime import parse_cpu_list
    from qvl.tasks import get_task

    tokens = args.max_image_tokens or (max(1, args.max_pixels // 1024) if args.max_pixels else None)
    if tokens is None and getattr(args, "task", None):
        tokens = get_task(args.task).max_image_tokens  # e.g. OCR reads small print at a larger budget
    return EngineOptions(
        model=getattr(args, "model", None), dtype=args.dtype, weights=args.weights, group_size=args.group_size,
        vision_int8=args.vision_int8, int8_activations=args.int8_activations, threads=args.threads,
        cpus=tuple(parse_cpu_list(args.cpus)) if args.cpus else None,
        max_image_tokens=tokens or DEFAULT_MAX_IMAGE_TOKENS, image_tokens_cap=args.image_tokens_cap,
        vision_cache_mb=args.vision_cache_mb,
        prefix_cache_mb=args.prefix_cache_mb, answer_cache_entries=args.answer_cache, max_batch=args.max_batch,
        kv_cache_mb=args.kv_cache_mb, deterministic=args.deterministic, reasoning_budget=args.reasoning_budget,
        video=VideoSettings(fps=args.fps, max_frames=args.max_frames, max_tokens=args.max_video_tokens),
        video_tokens_cap=args.video_tokens_cap,
        max_video_seconds=args.max_video_seconds,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags, --task, and the answer's constraint (one of --json-schema, --grammar, --regex)."""
    from qvl.tasks import TASKS

    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float, help="keep tokens at least this fraction as likely as the top one")
    g.add_argument("--min-tokens", type=int, help="do not end (EOS) before this many tokens")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="generate exactly --max-new-tokens")
    g.add_argument("--logprobs", type=int, metavar="K",
                   help="with --json: each token's log-probability and its K (0-20) best alternatives")
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--think", action=argparse.BooleanOptionalAction,
                   help="a template with a thinking switch (Qwen3.5): think before answering, or not "
                        "(default: the template's, thinking on for Qwen3.5)")
    g.add_argument("--task", choices=list(TASKS),
                   help="a preset prompt: describe; ocr (greedy); markdown, html (a document page as Markdown or "
                        "HTML, tables kept); detect, point (the PROMPT names what to find, e.g. \"cats, bicycles\": "
                        "boxes or points in the image's pixels, with --json or --draw)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="the answer is JSON valid under this JSON Schema file, on one line ({} allows any "
                            "JSON); with --json the parsed answer is printed under \"json\" too")
    shape.add_argument("--grammar", metavar="FILE",
                       help="the answer matches this Lark grammar, in llguidance's dialect (%%json {...} "
                            "embeds a JSON schema)")
    shape.add_argument("--regex", metavar="PATTERN", help="the answer matches this regular expression")


@dataclass(frozen=True)
class SamplingOptions:
    """What a user asked of sampling; None keeps the checkpoint's generation_config default.
    Picklable (a Ray actor builds its SamplingParams from it against its own engine)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    task: str | None = None  # a preset: a greedy one samples greedily unless a temperature is given
    constraint: Constraint | None = None  # what the answer must match
    think: bool | None = None  # the chat template's thinking switch (None: the template's default)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SamplingOptions:
        """The flags of `add_sampling_args`; the constraint's file is read and checked here
        (UsageError before any model loads)."""
        return cls(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
            stop=tuple(args.stop) if args.stop else None, task=args.task, constraint=constraint_from_args(args),
            think=args.think,
        )

    @property
    def template_kwargs(self) -> dict:
        """The chat template variables these options set (Request.template_kwargs)."""
        return {} if self.think is None else {"enable_thinking": self.think}

    @property
    def grounding(self) -> bool:
        """The task's answers hold boxes or points."""
        from qvl.tasks import get_task

        return self.task is not None and get_task(self.task).grounding

    def params(self, engine: Engine) -> SamplingParams:
        """These options over the engine's checkpoint defaults."""
        from qvl.tasks import get_task

        greedy = self.task is not None and get_task(self.task).greedy
        temperature = self.temperature if self.temperature is not None else (0.0 if greedy else None)
        return engine.sampling_defaults(
            max_new_tokens=self.max_new_tokens, temperature=temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=self.logprobs,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            stop=self.stop, constraint=self.constraint,
        )


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """--json-schema FILE, --grammar FILE or --regex PATTERN as a Constraint (None without them),
    checked before any model loads: a file that cannot be read, a schema that is not JSON, a
    grammar llguidance cannot compile raise UsageError (exit status 2). The engine compiles it
    again against its tokenizer when each request is parsed."""
    from qvl.grammar import Constraint

    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--grammar", args.grammar),
                                               ("--regex", args.regex)) if value is not None]
    if not given:
        return None
    flag, value = given[0]  # argparse lets one through at most
    if args.ignore_eos:
        raise UsageError(f"--ignore-eos cannot be combined with {flag}: the constraint decides where the answer ends")
    if flag == "--regex":
        constraint = Constraint("regex", value)
    else:
        try:
            with open(value, encoding="utf-8-sig") as f:  # a byte-order mark is no reason to refuse a file
                source = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{flag} {value}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
        constraint = Constraint("lark", source) if flag == "--grammar" else json_schema_constraint(value, source)
    if problem := constraint.problem():
        raise UsageError(f"{flag} {value}: cannot enforce this {constraint.name}: {problem}")
    return constraint


def json_schema_constraint(path: str, source: str) -> Constraint:
    from qvl.grammar import Constraint

    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise UsageError(f"--json-schema {path}: not JSON ({exc.msg} at {where})") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {path}: a JSON schema must be a JSON object ({{...}})")
    return Constraint.json(schema)


def prompt_text(prompt: str | None, task: str | None) -> str:
    """The prompt a PROMPT (- reads stdin) and a --task make: a task with a subject fills the
    PROMPT into its own; a PROMPT wins over a task without one; ValueError with neither."""
    from qvl.tasks import get_task

    if prompt == "-":
        prompt = sys.stdin.read()
    preset = get_task(task) if task else None
    if preset is not None and preset.subject is not None:
        return preset.prompt_for(prompt)  # the PROMPT names what to find
    if not prompt:
        if preset is None:
            raise ValueError("give a PROMPT (or - to read it from stdin), or a --task")
        prompt = preset.prompt
    return prompt
