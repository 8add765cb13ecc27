"""Video input: time to first token for a clip against transformers, and peak
memory of a long clip against a short one, at qvl's default video settings (2 frames per
second, at most 64 frames, 1024 video tokens per clip).

    python benchmarks/video.py --model /work/ckpt/qvl-2b --rounds 3
    python benchmarks/video.py --model /work/ckpt/qvl-2b --only ttft
    python benchmarks/video.py --model /work/ckpt/qvl-2b --only rss
    python benchmarks/video.py --model /work/ckpt/qvl-2b --only budgets --budgets 256 512 1024 2048

    # the script itself on a tiny random checkpoint and tiny clips
    python -m qvl.cli synth /tmp/vb/tiny
    python benchmarks/video.py --model /tmp/vb/tiny --clips /tmp/vb/clips --size 320x180 \\
        --seconds 4 --long-seconds 20 --rounds 2 --budgets 256 1024

Clips are synthetic (qvl.bench.synthetic_clip: H.264, moving test card), WIDTHxHEIGHT at 30
fps, written once into --clips and reused (the 10-minute 1280x720 clip takes a few minutes
to write; that is never inside a measurement).

Figure 1 (--only ttft): time to first token of "Describe this clip." about a --seconds clip
(default 30 s, 1280x720), each side in a fresh process per round, the order alternating:
- qvl: Engine with default options (int8 weights etc.) and its caches off (vision, prefix,
  answer, decoded clips; --qvl-caches default keeps them as the defaults have them: they
  cannot hit in a fresh process, but their bookkeeping is then paid), warm_up(), then the
  wall clock around engine.generate(request) with max_new_tokens=1: decoding the file,
  sampling and resizing the frames, tokenizing, the vision tower, prefill. Also printed: the
  decode+preprocess time (qvl.requests.load_video) and Done.timings' vision_ms and
  prefill_ms (ttft less the vision tower and the parse: decoding the clip, tokenizing).
- transformers: Qwen3VLForConditionalGeneration in bfloat16 (its best CPU dtype on this
  machine; it has no int8 path), one warm-up generate on
  a tiny 4-frame clip, then the wall clock around transformers.video_utils.load_video(path,
  backend="pyav") + Qwen3VLProcessor + generate(max_new_tokens=1). The frames are sampled
  while decoding (load_video's sample_indices_fn = the video processor's sample_frames: what
  the processor does itself with a file path when its torchcodec decoder is installed);
  --hf-frames all decodes every frame first and lets the processor sample them instead
  (slower, and 900 frames of 1280x720 hold 2.5 GB). The processor
  is set to qvl's settings (fps, max_frames, min_frames, the pixel budget longest_edge =
  max_tokens * 32 * 32 * 2, shortest_edge 4096, cap_pixels_per_frame=True): both sides see
  the same prompt, checked every round (the number of video tokens and a hash of the ids).
  transformers' video processor needs torchvision, which cannot be installed beside this
  torch: TorchvisionCalls stands in for its three calls.
Printed per round, then medians (min-max) and the ratio of the medians.

Figure 2 (--only rss): qvl's peak RSS (getrusage) for the --long-seconds clip (default 600 s,
18,000 frames) against the --seconds clip, same settings, each in a fresh process, order
alternating; with each process's peak after loading and after warm_up (before the clip), so
the clip's own share shows, and each TTFT.

--budgets N ...: qvl's TTFT on the --seconds clip per max_video_tokens (order reversed every
other round): what each clip budget costs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

PROMPT = "Describe this clip."
NO_CACHES = {"vision_cache_mb": 0, "prefix_cache_mb": 0, "answer_cache_entries": 0, "clip_cache_mb": 0}


# ---------------------------------------------------------------------------------------------
# Workers: one measurement each, in a fresh process; the last stdout line is a JSON object


def ids_digest(ids) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def qvl_worker(args) -> dict:
    import qvl.requests
    from qvl.bench import peak_rss_mb
    from qvl.engine import Engine, EngineOptions, Request
    from qvl.processing.video import VideoSettings
    from qvl.sampling import SamplingParams

    caches = NO_CACHES if args.qvl_caches == "off" else {}
    engine = Engine.load(EngineOptions(model=args.model, threads=args.threads, int8_activations=args.int8_activations,
                                       video=VideoSettings(max_tokens=args.video_tokens), **caches))
    load_rss = peak_rss_mb()
    engine.warm_up()
    warm_rss = peak_rss_mb()

    clips, parsed = [], []
    load_video, parse = qvl.requests.load_video, engine.parse

    def timed_load_video(*a, **k):  # decode + sample + resize + pair: timed apart, otherwise unchanged
        started = time.perf_counter()
        clip = load_video(*a, **k)
        clips.append((clip, (time.perf_counter() - started) * 1000))
        return clip

    def kept_parse(request):  # what generate runs, kept to check the prompt against transformers'
        out = parse(request)
        parsed.append(out)
        return out

    qvl.requests.load_video, engine.parse = timed_load_video, kept_parse
    request = Request([{"role": "user", "content": [{"type": "video", "video": args.clip},
                                                    {"type": "text", "text": PROMPT}]}],
                      SamplingParams(temperature=0, max_new_tokens=1))
    started = time.perf_counter()
    done = engine.generate(request)
    ttft = (time.perf_counter() - started) * 1000
    assert len(clips) == 1 and len(parsed) == 1, "the clip must be decoded once"
    (clip, decode_ms), ids = clips[0], parsed[0].ids
    t = done.timings
    return {"ttft_ms": ttft, "engine_ttft_ms": t.ttft_ms, "decode_ms": decode_ms, "vision_ms": t.vision_ms,
            "prefill_ms": t.prefill_ms, "video_tokens": int((ids == engine.cfg.video_token_id).sum()),
            "prompt_tokens": len(ids), "ids": ids_digest(ids.tolist()), "frames": len(clip.indices),
            "frame_size": list(clip.pairs[0].size), "clip_frames": clip.info.total_frames,
            "load_rss_mb": load_rss, "warm_rss_mb": warm_rss, "peak_rss_mb": peak_rss_mb(),
            "weights": engine.weights, "model_id": engine.model_id}


def hf_worker(args) -> dict:
    from functools import partial, wraps

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_utils import VideoMetadata, load_video

    from qvl.bench import peak_rss_mb
    from qvl.processing.video import MIN_PIXELS, VideoSettings

    settings = VideoSettings(max_tokens=args.video_tokens)
    model_dir = Path(args.model)
    pre = json.loads((model_dir / "preprocessor_config.json").read_text())
    geometry = {k: pre[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")}
    factor = pre["patch_size"] * pre["merge_size"]
    # without torchvision the video processor's auto class is a placeholder: skip the class check
    ProcessorMixin.check_argument_for_proper_class = lambda *_: None
    videos = video_processor(**geometry, size={"shortest_edge": MIN_PIXELS,
                                                       "longest_edge": settings.max_tokens * factor * factor
                                                       * pre["temporal_patch_size"]},
                                       fps=settings.fps, max_frames=settings.max_frames, min_frames=settings.min_frames)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(**geometry, size=pre["size"]),
                                 tokenizer=AutoTokenizer.from_pretrained(str(model_dir)), video_processor=videos,
                                 chat_template=(model_dir / "chat_template.jinja").read_text())
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    load_rss = peak_rss_mb()

    vision = []
    get_video_features = model.model.get_video_features

    @wraps(get_video_features)  # generate picks the encoder's arguments by its signature
    def timed_video_features(*a, **k):
        started = time.perf_counter()
        out = get_video_features(*a, **k)
        vision.append((time.perf_counter() - started) * 1000)
        return out

    model.model.get_video_features = timed_video_features
    messages = [{"role": "user", "content": [{"type": "video", "video": args.clip}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def first_token(inputs):
        inputs.pop("video_metadata", None)
        with torch.inference_mode():
            return model.generate(**inputs, max_new_tokens=1, do_sample=False, eos_token_id=eos,
                                  pad_token_id=processor.tokenizer.pad_token_id)

    tiny = np.random.default_rng(0).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    first_token(processor(text=[text], videos=[tiny], video_metadata=[VideoMetadata(total_num_frames=4, fps=2.0)],
                          return_tensors="pt", videos_kwargs={"do_sample_frames": True, "cap_pixels_per_frame": True}))
    warm_rss = peak_rss_mb()
    vision.clear()

    sampled = args.hf_frames == "sampled"
    started = time.perf_counter()
    if sampled:  # only the sampled frames are kept, as the processor loads a file path
        frames, meta = load_video(args.clip, backend="pyav", sample_indices_fn=partial(videos.sample_frames,
                                                                                      fps=settings.fps))
    else:  # every frame, sampled by the processor
        frames, meta = load_video(args.clip, backend="pyav")
    decoded = time.perf_counter()
    inputs = processor(text=[text], videos=[frames], video_metadata=[meta], return_tensors="pt",
                       videos_kwargs={"do_sample_frames": not sampled, "cap_pixels_per_frame": True})
    prepared = time.perf_counter()
    first_token(inputs)
    ttft = (time.perf_counter() - started) * 1000
    ids = inputs["input_ids"][0]
    t, h, w = inputs["video_grid_thw"][0].tolist()
    return {"ttft_ms": ttft, "decode_ms": (decoded - started) * 1000, "preprocess_ms": (prepared - decoded) * 1000,
            "vision_ms": sum(vision), "prefill_ms": ttft - (prepared - started) * 1000 - sum(vision),
            "video_tokens": int((ids == model.config.video_token_id).sum()), "prompt_tokens": len(ids),
            "ids": ids_digest(ids.tolist()), "frames": len(meta.frames_indices),
            "frame_size": [h * pre["patch_size"], w * pre["patch_size"]], "decoded_frames": len(frames),
            "load_rss_mb": load_rss, "warm_rss_mb": warm_rss, "peak_rss_mb": peak_rss_mb()}


class TorchvisionCalls:
    """The three calls of torchvision.transforms.v2.functional that transformers' video processor
    makes, done as torchvision does them on CPU (torchvision cannot be installed beside this
    torch): uint8 frames go straight to torch's antialiased interpolate, normalize is sub_ then
    div_ in float32."""

    import enum

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    @staticmethod
    def resize(image, size, interpolation, antialias=True):
        import torch

        if tuple(image.shape[-2:]) == tuple(size):
            return image
        flat = image.reshape(-1, *image.shape[-3:])
        out = torch.nn.functional.interpolate(flat, size=list(size), mode=interpolation.value, antialias=antialias,
                                              align_corners=False)
        return out.reshape(*image.shape[:-2], *out.shape[-2:])

    @staticmethod
    def normalize(tensor, mean, std, inplace=False):
        import torch

        tensor = tensor if inplace else tensor.clone()
        mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub_(mean).div_(std)

    @staticmethod
    def grayscale_to_rgb(image):
        return image.expand(*image.shape[:-3], 3, *image.shape[-2:]) if image.shape[-3] == 1 else image


def video_processor(**kwargs):
    """transformers' Qwen3VLVideoProcessor, runnable without torchvision through TorchvisionCalls."""
    import transformers.image_processing_backends as backends
    import transformers.image_utils as image_utils
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    backends.tvF = video_utils.tvF = TorchvisionCalls
    modes = TorchvisionCalls.InterpolationMode
    image_utils.pil_torch_interpolation_mapping.update({PILImageResampling.BICUBIC: modes.BICUBIC,
                                                        PILImageResampling.BILINEAR: modes.BILINEAR})
    backends.pil_torch_interpolation_mapping = image_utils.pil_torch_interpolation_mapping
    return Qwen3VLVideoProcessor(**kwargs)


# ---------------------------------------------------------------------------------------------
# The driver


def clip_path(args, seconds: float) -> Path:
    """The synthetic clip of `seconds` at --size and --clip-fps, written once into --clips."""
    width, height = args.size
    path = args.clips / f"synthetic-{width}x{height}-{args.clip_fps}fps-{seconds:g}s.mp4"
    if not path.exists():
        from qvl.bench import synthetic_clip

        args.clips.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ({round(seconds * args.clip_fps)} frames) ...", flush=True)
        started = time.perf_counter()
        part = path.with_name(path.stem + ".part.mp4")
        synthetic_clip(part, seconds, width, height, fps=args.clip_fps, container="mp4")
        os.replace(part, path)  # an interrupted write leaves no clip that looks finished
        print(f"  {path.stat().st_size / 2**20:.0f} MB in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def run(kind: str, args, clip: Path, video_tokens: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--clip", str(clip),
           "--model", str(args.model), "--threads", str(args.threads), "--video-tokens", str(video_tokens),
           "--hf-frames", args.hf_frames, "--qvl-caches", args.qvl_caches, "--int8-activations", args.int8_activations]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{kind} worker failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def seconds(ms: float) -> str:
    return f"{ms / 1000:.2f} s"


def figure_ttft(args) -> None:
    clip = clip_path(args, args.seconds)
    w, h = args.size
    print(f"\n== time to first token, {args.seconds:g} s {w}x{h} clip at {args.clip_fps} fps, {args.threads} threads, "
          f"{args.video_tokens} video tokens budget ==", flush=True)
    runs: dict[str, list[dict]] = {"qvl": [], "hf": []}
    for rnd in range(args.rounds):
        for kind in (("qvl", "hf") if rnd % 2 == 0 else ("hf", "qvl")):
            runs[kind].append(run(kind, args, clip, args.video_tokens))
        q, t = runs["qvl"][-1], runs["hf"][-1]
        same = (q["video_tokens"], q["prompt_tokens"], q["ids"]) == (t["video_tokens"], t["prompt_tokens"], t["ids"])
        assert same, f"the two sides' prompts differ: qvl {q}, transformers {t}"
        print(f"round {rnd + 1} ({'qvl first' if rnd % 2 == 0 else 'transformers first'}): "
              f"{q['video_tokens']} video tokens ({q['frames']} frames of {q['frame_size'][1]}x{q['frame_size'][0]}), "
              f"prompt {q['prompt_tokens']} tokens, same ids on both sides", flush=True)
        print(f"  qvl          {seconds(q['ttft_ms'])}  (decode+preprocess {seconds(q['decode_ms'])}, vision "
              f"{seconds(q['vision_ms'])}, prefill {seconds(q['prefill_ms'])}; peak RSS {q['peak_rss_mb']:.0f} MB)",
              flush=True)
        print(f"  transformers {seconds(t['ttft_ms'])}  (decode {seconds(t['decode_ms'])}, preprocess "
              f"{seconds(t['preprocess_ms'])}, vision {seconds(t['vision_ms'])}, prefill {seconds(t['prefill_ms'])}; "
              f"peak RSS {t['peak_rss_mb']:.0f} MB)  ratio {t['ttft_ms'] / q['ttft_ms']:.2f}x", flush=True)

    def col(kind, key):
        return [r[key] / 1000 for r in runs[kind]]

    q, t = runs["qvl"][0], runs["hf"][0]
    print(f"\n{q['video_tokens']} video tokens ({q['frames']} frames, {q['frame_size'][1]}x{q['frame_size'][0]}), "
          f"prompt {q['prompt_tokens']} tokens; qvl {q['weights']} ({q['model_id']}, caches {args.qvl_caches}), "
          f"transformers bf16 "
          f"({'sampled while decoding' if args.hf_frames == 'sampled' else 'every frame decoded'}); medians "
          f"(min-max) of {args.rounds} alternating rounds, seconds\n")
    print("| | TTFT | decode+preprocess | vision | prefill |\n|---|---|---|---|---|")
    print(f"| qvl | {common.spread(col('qvl', 'ttft_ms'))} | {common.spread(col('qvl', 'decode_ms'))} | "
          f"{common.spread(col('qvl', 'vision_ms'))} | {common.spread(col('qvl', 'prefill_ms'))} |")
    hf_pre = [(r["decode_ms"] + r["preprocess_ms"]) / 1000 for r in runs["hf"]]
    print(f"| transformers bf16 | {common.spread(col('hf', 'ttft_ms'))} | {common.spread(hf_pre)} | "
          f"{common.spread(col('hf', 'vision_ms'))} | {common.spread(col('hf', 'prefill_ms'))} |")
    ratio = statistics.median(col("hf", "ttft_ms")) / statistics.median(col("qvl", "ttft_ms"))
    per_round = [b / a for a, b in zip(col("qvl", "ttft_ms"), col("hf", "ttft_ms"))]
    print(f"\nTTFT transformers / qvl: {ratio:.2f}x (ratio of medians; per round {common.spread(per_round)})")


def figure_rss(args) -> None:
    short, long = clip_path(args, args.seconds), clip_path(args, args.long_seconds)
    w, h = args.size
    print(f"\n== qvl peak RSS, {args.long_seconds:g} s against {args.seconds:g} s ({w}x{h}, {args.clip_fps} fps), "
          f"{args.video_tokens} video tokens budget ==", flush=True)
    runs: dict[str, list[dict]] = {"short": [], "long": []}
    names = {"short": f"{args.seconds:g} s", "long": f"{args.long_seconds:g} s"}
    for rnd in range(args.rounds):
        for kind in (("short", "long") if rnd % 2 == 0 else ("long", "short")):
            r = run("qvl", args, short if kind == "short" else long, args.video_tokens)
            runs[kind].append(r)
            print(f"round {rnd + 1} {names[kind]:>7}: peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"(loaded {r['load_rss_mb']:.0f}, warmed up {r['warm_rss_mb']:.0f}, "
                  f"clip +{r['peak_rss_mb'] - r['warm_rss_mb']:.0f}); "
                  f"{r['clip_frames']} frames -> {r['frames']} sampled, {r['video_tokens']} video tokens; "
                  f"TTFT {seconds(r['ttft_ms'])} (decode+preprocess {seconds(r['decode_ms'])})", flush=True)

    def col(kind, f):
        return [f(r) for r in runs[kind]]

    print(f"\nmedians (min-max) of {args.rounds} rounds, each in a fresh process\n")
    print("| clip | frames | video tokens | peak RSS MB | after load MB | after warm-up MB | clip's share MB | TTFT s |"
          "\n|---|---|---|---|---|---|---|---|")
    for kind in ("short", "long"):
        r = runs[kind][0]
        print(f"| {names[kind]} | {r['clip_frames']} -> {r['frames']} | {r['video_tokens']} | "
              f"{common.spread(col(kind, lambda r: r['peak_rss_mb']), '{:.0f}')} | "
              f"{common.spread(col(kind, lambda r: r['load_rss_mb']), '{:.0f}')} | "
              f"{common.spread(col(kind, lambda r: r['warm_rss_mb']), '{:.0f}')} | "
              f"{common.spread(col(kind, lambda r: r['peak_rss_mb'] - r['warm_rss_mb']), '{:.0f}')} | "
              f"{common.spread(col(kind, lambda r: r['ttft_ms'] / 1000))} |")
    ratio = (statistics.median(col("long", lambda r: r["peak_rss_mb"]))
             / statistics.median(col("short", lambda r: r["peak_rss_mb"])))
    print(f"\npeak RSS {names['long']} / {names['short']}: {ratio:.3f} (ratio of medians)")


def figure_budgets(args) -> None:
    clip = clip_path(args, args.seconds)
    print(f"\n== qvl TTFT per video token budget, {args.seconds:g} s clip ==", flush=True)
    runs: dict[int, list[dict]] = {b: [] for b in args.budgets}
    for rnd in range(args.rounds):
        for budget in (args.budgets if rnd % 2 == 0 else args.budgets[::-1]):
            r = run("qvl", args, clip, budget)
            runs[budget].append(r)
            print(f"round {rnd + 1} budget {budget}: {r['video_tokens']} tokens, TTFT {seconds(r['ttft_ms'])} "
                  f"(decode+preprocess {seconds(r['decode_ms'])}, vision {seconds(r['vision_ms'])}, prefill "
                  f"{seconds(r['prefill_ms'])})", flush=True)
    print(f"\nmedians (min-max) of {args.rounds} rounds, seconds\n")
    print("| budget | video tokens | frames | frame | TTFT | decode+preprocess | vision | prefill |"
          "\n|---|---|---|---|---|---|---|---|")
    for budget, rs in runs.items():
        r = rs[0]
        print(f"| {budget} | {r['video_tokens']} | {r['frames']} | {r['frame_size'][1]}x{r['frame_size'][0]} | "
              + " | ".join(common.spread([x[k] / 1000 for x in rs]) for k in ("ttft_ms", "decode_ms", "vision_ms",
                                                                         "prefill_ms")) + " |")


def main() -> None:
    from qvl.bench import parse_size
    from qvl.processing.video import DEFAULT_MAX_VIDEO_TOKENS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/work/ckpt/qvl-2b")
    p.add_argument("--clips", type=Path, default=Path("/work/ckpt/clips"), help="where the synthetic clips are kept")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30, help="the clip of figure 1 (and the short one of figure 2)")
    p.add_argument("--long-seconds", type=float, default=600, help="the long clip of figure 2")
    p.add_argument("--size", type=parse_size, default=(1280, 720), help="WIDTHxHEIGHT of the clips")
    p.add_argument("--clip-fps", type=int, default=30)
    p.add_argument("--video-tokens", type=int, default=DEFAULT_MAX_VIDEO_TOKENS,
                   help="the clip's token budget (default: qvl's default)")
    p.add_argument("--only", choices=["ttft", "rss", "budgets"], help="one figure (default: ttft, rss, and budgets "
                   "when --budgets is given)")
    p.add_argument("--budgets", type=int, nargs="+", help="qvl's TTFT per max_video_tokens, e.g. 256 512 1024 2048")
    p.add_argument("--hf-frames", choices=["sampled", "all"], default="sampled",
                   help="transformers: keep only the sampled frames while decoding, or decode all and sample after")
    p.add_argument("--qvl-caches", choices=["off", "default"], default="off",
                   help="qvl's caches off (default), or as the default options have them (each measurement is a "
                   "fresh process either way, so they cannot hit; on, their bookkeeping is paid: the clip cache "
                   "hashes the whole file, the prefix cache copies the prompt's KV)")
    p.add_argument("--int8-activations", choices=["auto", "off", "vision", "all"], default="auto",
                   help="qvl's --int8-activations (default auto, as qvl runs by default)")
    p.add_argument("--worker", choices=["qvl", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--clip", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps((qvl_worker if args.worker == "qvl" else hf_worker)(args)))
        return
    if args.only == "budgets" and not args.budgets:
        p.error("--only budgets needs --budgets")
    if args.only in (None, "ttft"):
        figure_ttft(args)
    if args.only in (None, "rss"):
        figure_rss(args)
    if args.budgets and args.only in (None, "budgets"):
        figure_budgets(args)


if __name__ == "__main__":
    main()
