"""`qvl` command line: a table of subcommands, each a small function."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable

from qvl import __version__
from qvl.options import SamplingOptions, UsageError, add_engine_args, add_sampling_args, engine_options, prompt_text

FRONT_DOORS: tuple[str, ...] = ("qvl.batch.cli", "qvl.server.cli", "qvl.eval.cli", "qvl.retrieval.cli",
                               "qvl.retrieval.index_cli", "qvl.models_cli")


def expected_errors() -> tuple[type[BaseException], ...]:
    """What a user's input or files can cause: one line, no traceback."""
    from jinja2 import TemplateError
    from safetensors import SafetensorError

    return ValueError, RuntimeError, OSError, SafetensorError, TemplateError


def user_message(text: str, images: list, videos: list = ()) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": im} for im in images]
            + [{"type": "video", "video": clip} for clip in videos] + [{"type": "text", "text": text}]}


def check_files(paths: list[str], kind: str = "image") -> None:
    from qvl.processing.pdf import split_pages

    for path in paths:
        if not os.path.isfile(split_pages(path)[0] if kind == "image" else path):
            raise ValueError(f"{kind} file not found: {path}")


def question_images(images: list[str], grounding: bool) -> list[list[str]]:
    """The images of each question `ask` asks: all in one, or for a grounding task one
    question per image and per PDF page, so each answer's boxes belong to one picture."""
    from qvl.processing.pdf import is_pdf, page_count, parse_pages, split_pages

    if not grounding or len(images) == 0:
        return [images]
    singles = []
    for path in images:
        if is_pdf(path):
            base, spec = split_pages(path)
            singles += [f"{base}#pages={n}" for n in parse_pages(spec, page_count(base))]
        else:
            singles.append(path)
    return [[p] for p in singles] if len(singles) > 1 else [singles]


def cmd_ask(args: argparse.Namespace) -> int:
    from qvl.engine import Engine, Request
    from qvl.stream import Delta, Done

    check_files(args.image)
    check_files(args.video, "video")
    if args.draw and not args.image:
        raise ValueError("--draw needs an image (-i) to draw on")
    text = prompt_text(args.prompt, args.task)
    sampling = SamplingOptions.from_args(args)
    constraint = sampling.constraint
    grounding = bool(args.draw) or sampling.grounding
    engine = Engine.load(engine_options(args))
    questions = question_images(args.image, grounding)
    for k, images in enumerate(questions):
        parsed = engine.parse(Request([user_message(text, images, args.video)], sampling.params(engine),
                                      template_kwargs=sampling.template_kwargs))
        for event in engine.stream(parsed):
            if isinstance(event, Delta) and not args.json:
                show_reasoning(event.reasoning, args.hide_reasoning)
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Done):
                found = answer_boxes(engine, parsed, images, event.text, args.draw, k if len(questions) > 1 else None) \
                    if grounding else None
                if args.json:
                    out = event.to_dict()
                    if constraint is not None and constraint.kind == "json_schema":
                        try:
                            out["json"] = json.loads(event.text)
                        except json.JSONDecodeError:  # cut by --max-new-tokens or a --stop string
                            pass
                    print(json.dumps({**out, **(found or {})}, ensure_ascii=False))
                else:
                    sys.stdout.write("\n")
                    if event.finish_reason == "length":
                        print(f"[answer cut at {event.usage.completion_tokens} tokens: raise --max-new-tokens]",
                              file=sys.stderr)
                    if found is not None:
                        drawn = f", drawn on {found['drawn']}" if "drawn" in found else ""
                        print(f"[{found.get('image', 'no image')}: {len(found['boxes'])} box(es), "
                              f"{len(found['points'])} point(s){drawn}]", file=sys.stderr)
    return 0


def answer_boxes(engine, parsed, images: list[str], text: str, draw_to: str | None, index: int | None) -> dict:
    """The answer's boxes and points in the pixels of the question's last image (as shown:
    EXIF orientation applied; a PDF page as rasterised), drawn on it when asked."""
    from pathlib import Path

    from qvl.grounding import draw, grounding
    from qvl.processing.image import max_pixels_for_tokens
    from qvl.requests import pictures_of

    found = grounding(text, parsed.last_image_size)
    if images:
        found["image"] = images[-1]
    if draw_to and images:
        max_pixels = max_pixels_for_tokens(engine.limits.max_image_tokens, engine.image_cfg)
        picture = pictures_of({"image": images[-1]}, max_pixels, 1)[0]
        out = Path(draw_to)
        if index is not None:  # one question per image: out-1.png, out-2.png, ...
            out = out.with_name(f"{out.stem}-{index + 1}{out.suffix}")
        draw(picture, found).save(out)
        found["drawn"] = str(out)
    return found


def cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat on the terminal; earlier turns are reused from the prefix cache."""
    from qvl.engine import Engine, Request
    from qvl.processing.pdf import split_pages

    check_files(args.image)
    check_files(args.video, "video")
    sampling = SamplingOptions.from_args(args)
    engine = Engine.load(engine_options(args))
    params = sampling.params(engine)
    history: list[dict] = []
    pending, clips = list(args.image), list(args.video)
    print("qvl chat: type a message; /image PATH attaches a picture (or a PDF: doc.pdf#pages=2), /video PATH a "
          "clip, /reset forgets, /quit leaves.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history, pending, clips = [], [], []
            continue
        if line.startswith(("/image ", "/video ")):
            kind, path = line[1:6], line[len("/image "):].strip()
            if os.path.isfile(split_pages(path)[0] if kind == "image" else path):  # doc.pdf#pages=2 too
                (pending if kind == "image" else clips).append(path)
            else:
                print(f"[no such {kind} file: {path}]", file=sys.stderr)
            continue
        if not line:
            continue
        history.append(user_message(line, pending, clips))
        try:
            text = chat_turn(engine, Request(history, params, template_kwargs=sampling.template_kwargs),
                             args.hide_reasoning)
        except (*expected_errors(), KeyboardInterrupt) as exc:  # this turn is lost, the session goes on
            history.pop()
            print(f"\n[{'stopped' if isinstance(exc, KeyboardInterrupt) else f'error: {exc}'}]", file=sys.stderr)
            continue
        pending, clips = [], []
        history.append({"role": "assistant", "content": text})


def show_reasoning(piece: str, hidden: bool) -> None:
    """A Thinking model's reasoning goes to stderr, dimmed on a terminal, apart from the answer."""
    if not piece or hidden:
        return
    dim = sys.stderr.isatty()
    sys.stderr.write(f"\x1b[2m{piece}\x1b[0m" if dim else piece)
    sys.stderr.flush()


def chat_turn(engine, request, hide_reasoning: bool = False) -> str:
    """Stream one turn's answer (its reasoning apart); returns the answer's text."""
    from qvl.stream import Delta, Done

    text = ""
    for event in engine.stream(request):
        if isinstance(event, Delta):
            show_reasoning(event.reasoning, hide_reasoning)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Done):
            text = event.text
            t = event.timings
            print(f"\n[{t.ttft_ms:.0f} ms to first token, {t.decode_ms_per_token:.0f} ms/token, "
                  f"{t.reused_tokens} prompt tokens reused]", file=sys.stderr)
    return text


def cmd_bench(args: argparse.Namespace) -> int:
    from qvl.bench import format_report, parse_size, run_bench, synthetic_image
    from qvl.engine import Engine
    from qvl.processing.image import load_image

    image = load_image(args.image_file) if args.image_file else (
        synthetic_image(*parse_size(args.image)) if args.image != "none" else None)
    options = engine_options(args)
    if not args.with_caches:
        from dataclasses import replace

        options = replace(options, vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0)
    if not 1 <= args.concurrency <= options.max_batch:
        raise ValueError(f"--concurrency must be between 1 and --max-batch ({options.max_batch})")
    engine = Engine.load(options)
    report = run_bench(engine, image, args.new_tokens, args.repeat, options.max_image_tokens, args.concurrency)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from qvl.quantize import QuantSpec
    from qvl.synth import write_checkpoint

    changes = {"text_config": {"num_hidden_layers": args.layers}} if args.layers else None
    if args.vision_int8 and args.weights == "bf16":
        raise ValueError("--vision-int8 quantises the vision tower of an int8 or int4 checkpoint: add --weights")
    quant = QuantSpec(args.weights, args.group_size, args.vision_int8) if args.weights != "bf16" else None
    out = write_checkpoint(args.out, args.preset, args.seed, changes, outliers=args.outliers, thinking=args.thinking,
                           quant=quant)
    kind = "an outlier stress" if args.outliers else "a random-weight Thinking" if args.thinking else "a random-weight"
    print(f"wrote {kind} '{args.preset}' checkpoint ({args.weights} weights) to {out}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qvl.hub import resolve_model
    from qvl.quantize import QuantSpec
    from qvl.weights import save_quantized

    path = resolve_model(args.input)
    spec = QuantSpec(args.weights, args.group_size, bool(args.vision_int8))
    calibration = calibration_images(path, Path(args.calibrate), args.calibrate_images) if args.calibrate else None
    out = save_quantized(path, Path(args.output), spec, calibration)
    smoothed = f", vision tower smoothed from {len(calibration)} images" if calibration else ""
    print(f"wrote {spec.weights} weights to {out}{smoothed}")
    return 0


def calibration_images(model_dir, folder, limit: int):
    """The first `limit` images of a folder (sorted), preprocessed at the default budget."""
    from qvl.batch.inputs import IMAGE_EXTENSIONS
    from qvl.engine import DEFAULT_MAX_IMAGE_TOKENS
    from qvl.processing.image import ImageProcessorConfig, load_image, max_pixels_for_tokens, preprocess

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)[:limit] \
        if folder.is_dir() else []
    if not files:
        raise ValueError(f"--calibrate {folder}: no images there (extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    cfg = ImageProcessorConfig.from_file(model_dir / "preprocessor_config.json")
    max_pixels = max_pixels_for_tokens(DEFAULT_MAX_IMAGE_TOKENS, cfg)
    images = [preprocess(load_image(f), cfg, max_pixels=max_pixels) for f in files]
    return [(image.pixel_values, image.grid_thw) for image in images]


def cmd_info(args: argparse.Namespace) -> int:
    import platform
    from pathlib import Path

    import torch

    from qvl.engine import DEFAULT_WEIGHTS
    from qvl.kernels.build import tiers
    from qvl.kernels.library import library
    from qvl.kernels.plan import Plan
    from qvl.runtime import choose_dtype, core_cpus, cpu_flags, cpu_model, huge_pages, physical_cores
    from qvl.threads import BUSY_SLACK, busy_over, prompt_threads, read_cpu_times, torch_threads
    from qvl.weights import checkpoint_quantization

    busy = busy_over(read_cpu_times, 0.25)
    flags = cpu_flags()
    wanted = ["asimd", "asimddp", "i8mm", "bf16"] if platform.machine().lower() in ("arm64", "aarch64") else [
        "avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    lib = library()
    # the default options' plan, for a pre-quantised checkpoint's weights when --model names a folder of one
    stored = checkpoint_quantization(Path(args.model)) if args.model and Path(args.model).is_dir() else None
    plan = Plan.choose(lib, choose_dtype("auto", lib.tier.bf16), stored.weights if stored else DEFAULT_WEIGHTS,
                       stored_vision=stored.vision if stored else None)
    entries = plan.entries()
    if plan.weights != "int4":  # what int4 weights' products run with the same defaults
        int4 = Plan.choose(lib, plan.dtype, "int4").entries()
        entries["int4 linears, decode"] = int4["text linears, decode"]
        entries["int4 linears, prefill"] = int4["text linears, prefill"]
    info = {
        "qvl": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "cpu": cpu_model(), "cpu_features": {f: f in flags for f in wanted},
        "tiers_available": ", ".join(t.name for t in tiers()),
        "dtype_auto": str(plan.dtype).replace("torch.", ""),
        "threads_default": physical_cores(),
        # what an engine with the default threads would give torch's own ops and a prompt's kernels
        # now (decoding keeps all)
        "threads_torch_now": torch_threads(physical_cores(), busy or 0.0),
        "threads_prompt_now": prompt_threads(physical_cores(), busy or 0.0),
        # ... and whether its threads would be pinned, one per core, the engine's on a free one
        "threads_pinned_now": ((busy or 0.0) >= BUSY_SLACK and len(core_cpus()) == physical_cores() >= 2
                               and torch_threads(physical_cores(), busy or 0.0) == 1),
        "cores_busy_elsewhere": None if busy is None else round(busy, 2),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda_visible": torch.cuda.is_available(),
        "huge_pages": huge_pages(),
        "kernels": lib.describe(),
        "plan": {kind: {"kernel": k.name, "code_bits": k.code_bits, "group": k.group,
                        "dtype": str(k.dtype).replace("torch.", "")} for kind, k in entries.items()},
    }
    if args.model:
        info["model"] = model_needs(args.model)
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            if key in ("model", "plan"):
                continue
            if isinstance(value, dict):
                value = " ".join(f"{k}{'+' if v else '-'}" for k, v in value.items())
            print(f"{key:22} {value}")
        print(f"plan ({plan.weights} weights, int8 x int8: {plan.activations}; "
              "kernel, activation codes[/columns per step], dtype):")
        for kind, k in info["plan"].items():
            codes = (f"{k['code_bits']}-bit" + (f"/{k['group']}" if k["group"] else "")) if k["code_bits"] else "float"
            print(f"  {kind:24} {k['kernel']:21} {codes:10} {k['dtype']}")
        if args.model:
            needs = info["model"]
            print(f"\n{args.model}: reads {needs['read_gb_per_s']} GB/s here, {needs['available_gb']} GB available; "
                  f"KV cache {needs['kv_mb_per_1k_tokens']} MB per 1k tokens of context"
                  + (f", recurrent state {needs['state_mb_per_sequence']} MB per sequence"
                     if "state_mb_per_sequence" in needs else ""))
            for fmt, f in needs["formats"].items():
                print(f"  {fmt:5} weights {f['total_gb']:6.2f} GB, a decode step reads {f['decode_read_gb']:.2f} GB: "
                      f"about {f['decode_ms_per_token_estimate']:.0f} ms/token" + ("" if f["fits_in_available_memory"]
                                                                            else "  (does not fit)"))
    return 0


PRESETS = ["tiny", "tiny-moe", "2b", "4b", "8b", "32b", "30b-a3b", "qwen3.5-tiny", "qwen3.5-tiny-moe", "qwen3.5-0.8b",
           "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b",
           *(f"{kind}-{size}" for kind in ("embedding", "reranker") for size in ("tiny", "2b", "8b"))]


def model_needs(name: str) -> dict:
    """What a model needs on this machine: per weight format, the memory of its weights, what
    a decode step reads, and the time per token that takes at the read bandwidth measured now
    (an estimate: a busy machine reads slower, and qvl's kernels read faster than the probe);
    and the KV cache per 1k tokens of context (and a hybrid model's recurrent state per sequence)."""
    from pathlib import Path

    import psutil

    from qvl.config import ModelConfig
    from qvl.models import preset_of
    from qvl.sizing import FORMATS, footprint, read_bandwidth

    if Path(name).expanduser().is_dir():
        cfg = ModelConfig.from_file(Path(name).expanduser() / "config.json")
    elif preset := preset_of(name):  # no download needed to say what it needs
        from qvl.synth import preset_config

        cfg = ModelConfig.from_dict(preset_config(preset))
    else:
        from qvl.hub import resolve_model

        cfg = ModelConfig.from_file(resolve_model(name) / "config.json")
    bandwidth = read_bandwidth()
    available = psutil.virtual_memory().available
    formats = {}
    for fmt in FORMATS:
        f = footprint(cfg, fmt, vision_int8=fmt != "bf16")
        formats[fmt] = {**f.to_dict(), "decode_ms_per_token_estimate": round(f.read_per_token / bandwidth * 1000, 1),
                        "fits_in_available_memory": f.total_bytes + 2**30 < available}
    needs = {"read_gb_per_s": round(bandwidth / 1e9, 1), "available_gb": round(available / 1e9, 1),
             "kv_mb_per_1k_tokens": formats["int8"].pop("kv_mb_per_1k_tokens"), "formats": formats}
    if cfg.hybrid:  # the Gated DeltaNet layers' state, whatever the context length (and its snapshots)
        needs["state_mb_per_sequence"] = round(cfg.text.state_bytes() / 1e6, 1)
    return needs


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(prog="qvl", description="Qwen vision-language models (Qwen3-VL, Qwen3.5, Qwen3.6) on the CPU: ask, chat, serve, batch, bench.")
    parser.add_argument("--version", action="version", version=f"qvl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("ask", help="ask one question, optionally about images; streams the answer")
    p.add_argument("prompt", nargs="?", help="the question; - reads it from stdin")
    p.add_argument("-i", "--image", action="append", default=[],
                   help="image file, or a PDF (doc.pdf, or doc.pdf#pages=2-4: each page an image) (repeatable)")
    p.add_argument("-v", "--video", action="append", default=[],
                   help="video file (repeatable; MP4, WebM, MKV, MOV, AVI, ...: decoded by PyAV's own FFmpeg)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with text, ids, usage, timings (and boxes and points for --task "
                        "detect/point or --draw)")
    p.add_argument("--draw", metavar="OUT.png",
                   help="write the image with the answer's boxes and points drawn and labelled (one file per "
                        "image or page: OUT-1.png, ... when there are several)")
    p.add_argument("--hide-reasoning", action="store_true",
                   help="Thinking models: do not show the reasoning (it goes to stderr, dimmed, by default)")
    add_engine_args(p)
    add_sampling_args(p)
    commands["ask"] = cmd_ask

    p = sub.add_parser("chat", help="multi-turn chat on the terminal (earlier turns are not recomputed)")
    p.add_argument("-i", "--image", action="append", default=[], help="image for the first message (repeatable)")
    p.add_argument("-v", "--video", action="append", default=[], help="video for the first message (repeatable)")
    p.add_argument("--hide-reasoning", action="store_true", help="Thinking models: do not show the reasoning")
    add_engine_args(p)
    add_sampling_args(p)
    commands["chat"] = cmd_chat

    p = sub.add_parser("bench", help="measure load time, memory, vision, prefill and decode speed")
    p.add_argument("--image", default="1920x1080", help="synthetic image WIDTHxHEIGHT, or none (default 1920x1080)")
    p.add_argument("-i", dest="image_file", help="an image file instead of the synthetic one")
    p.add_argument("--new-tokens", type=int, default=32, help="decode exactly this many tokens (EOS ignored)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1, help="run the workload as N requests at once")
    p.add_argument("--with-caches", action="store_true", help="keep the caches on (default off: measure the work)")
    p.add_argument("--json", action="store_true")
    add_engine_args(p)
    commands["bench"] = cmd_bench

    p = sub.add_parser("synth", help="write a random-weight checkpoint in the official layout (offline demo)")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny", choices=PRESETS,
                   help="Qwen3-VL: tiny, tiny-moe, 2b ... 30b-a3b; Qwen3.5: qwen3.5-tiny ... qwen3.5-35b-a3b; "
                        "Qwen3-VL-Embedding and -Reranker: embedding-tiny, -2b, -8b, reranker-tiny, -2b, -8b")
    p.add_argument("--layers", type=int, help="text decoder layers (fewer than the preset's: a full-width model "
                                              "for benchmarks that fits the disk and memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outliers", action="store_true",
                   help="a stress checkpoint for int8 activations: plant trained-model-like outliers, 6 hidden "
                        "channels per tower (chosen by the seed) scaled 30-100x in every norm feeding a linear "
                        "(text input/post-attention RMSNorms, vision norm1/norm2 weight and bias), and 'massive "
                        "activations' (50, ~100x a residual entry) in 2 embedding dims of <|im_start|>, \\n and "
                        "<|vision_start|>; same layout and config.json, what was planted recorded in the "
                        "safetensors metadata (qvl_outliers)")
    p.add_argument("--thinking", action="store_true",
                   help="a Thinking variant: its chat template opens <think> for the answer; its sampling defaults")
    p.add_argument("--weights", default="bf16", choices=["bf16", "int8", "int4"],
                   help="int8/int4: write the pre-quantised checkpoint `qvl quantize` would make of the bf16 one, "
                        "tensor by tensor, without the bf16 file (30b-a3b in int4: ~17 GB instead of 62 GB)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    p.add_argument("--vision-int8", action="store_true",
                   help="with --weights: the vision tower int8 too, smoothed from its norms (as `qvl quantize`)")
    commands["synth"] = cmd_synth

    p = sub.add_parser("quantize", help="write a pre-quantised int8/int4 checkpoint that loads without re-quantising")
    p.add_argument("input", help="bf16 checkpoint folder or hub id")
    p.add_argument("output")
    p.add_argument("--weights", required=True, choices=["int8", "int4"])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--vision-int8", action="store_true", help="quantise the vision tower too (smoothed first)")
    p.add_argument("--calibrate", metavar="DIR", help="smooth the int8 vision tower from these images' activations "
                   "(SmoothQuant) instead of from its norms (data-free); needs --vision-int8")
    p.add_argument("--calibrate-images", type=int, default=16, help="how many of DIR's images (default 16)")
    commands["quantize"] = cmd_quantize

    p = sub.add_parser("info", help="CPU features, chosen dtype and threads, versions; with --model, what a "
                                    "model needs here")
    p.add_argument("--model", "-m", help="a model folder or a known hub id (Qwen/Qwen3-VL-8B-Instruct, ...): the "
                                         "memory each weight format needs and the decode speed to expect")
    p.add_argument("--json", action="store_true")
    commands["info"] = cmd_info

    for module in FRONT_DOORS:  # each registers its own subcommands
        importlib.import_module(module).register(sub, commands)
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("QVL_CUDA") != "1":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # a CPU engine: keep CUDA builds of torch quiet
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "cpus", None):  # pin here, in the main thread, so every thread started later inherits it
        from qvl.runtime import parse_cpu_list, pin

        try:
            pin(parse_cpu_list(args.cpus))
        except (ValueError, OSError) as exc:
            print(f"qvl {args.command}: error: --cpus {args.cpus}: {exc}", file=sys.stderr)
            return 2
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:  # the flags or files as given cannot work
        print(f"qvl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except expected_errors() as exc:
        print(f"qvl {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
