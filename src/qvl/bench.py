"""`qvl bench`: a fixed workload through the engine, reporting load time, peak memory,
vision, prefill, time to first token and decode speed."""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
from PIL import Image

from qvl.engine import Engine, Request
from qvl.sampling import SamplingParams

BENCH_PROMPT = "Describe this image in detail."


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like test card: smooth gradients plus noise (timings do not depend on content)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / max(width, 1), y / max(height, 1), (x + y) / max(width + height, 1)], -1) * 200
    return Image.fromarray((base + rng.normal(0, 20, base.shape)).clip(0, 255).astype("uint8"))


def synthetic_clip(path, seconds: float, width: int, height: int, fps: int = 30, codec: str = "libx264",
                   container: str | None = None, keyframe_every: int | None = None) -> Path:
    """Write a clip of moving test-card frames (a gradient that scrolls, a square that crosses
    it, a frame counter bar): every frame differs, and it compresses like footage, not noise.
    keyframe_every (x264): frames between keyframes, none added at scene changes."""
    import av

    path = Path(path)
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    base = (np.stack([x / max(width, 1), y / max(height, 1), (x + y) / max(width + height, 1)], -1) * 200
            + rng.normal(0, 6, (height, width, 3))).clip(0, 255).astype(np.uint8)
    side = max(2, min(width, height) // 6)
    with av.open(str(path), mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "30",
                              **({"g": str(keyframe_every), "sc_threshold": "0"} if keyframe_every else {})}
        for i in range(max(1, round(seconds * fps))):
            frame = np.roll(base, i * 4, axis=1)
            top, left = (i * 3) % max(1, height - side), (i * 7) % max(1, width - side)
            frame[top:top + side, left:left + side] = (255 - 8 * (i % 32), 40, 8 * (i % 32))
            frame[:4, : (i * 9) % width] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image takes WIDTHxHEIGHT, e.g. 1920x1080, not '{text}'") from None
    return w, h


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (Linux and macOS: getrusage; Windows: psutil)."""
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return getattr(info, "peak_wset", info.rss) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # macOS reports bytes, Linux KiB


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0


def run_bench(engine: Engine, image, new_tokens: int, repeat: int, max_image_tokens: int | None,
              concurrency: int = 1) -> dict:
    """Run the workload `repeat` times (exactly `new_tokens` each, EOS ignored), each time as
    `concurrency` identical requests at once (decoded together by the scheduler)."""
    content = ([{"type": "image", "image": image}] if image is not None else []) + [
        {"type": "text", "text": BENCH_PROMPT}]
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    request = Request([{"role": "user", "content": content}], params, max_image_tokens)
    runs = []
    for _ in range(repeat):
        if concurrency == 1:
            runs.append(engine.generate(request))
            continue
        for done in engine.generate_batch([request] * concurrency):
            if isinstance(done, BaseException):
                raise done
            runs.append(done)
    decode = [ms for run in runs for ms in run.timings.decode_ms]
    median = lambda key: statistics.median(getattr(r.timings, key) for r in runs)  # noqa: E731
    prompt_tokens = runs[0].usage.prompt_tokens
    prefill_ms = median("prefill_ms")
    return {
        "model": str(engine.path), "weights": engine.weights, "dtype": str(engine.model.dtype).replace("torch.", ""),
        "int8_activations": engine.int8_activations, "model_id": engine.model_id,
        "threads": engine.runtime.threads, "load_s": round(engine.load_s, 3), "peak_rss_mb": round(peak_rss_mb(), 1),
        "image_tokens": runs[0].usage.image_tokens, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "repeat": repeat, "vision_ms": round(median("vision_ms"), 1), "prefill_ms": round(prefill_ms, 1),
        "prefill_tokens_per_s": round(prompt_tokens / prefill_ms * 1000, 1) if prefill_ms else None,
        "ttft_ms": round(median("ttft_ms"), 1),
        "decode_ms_per_token": round(statistics.median(decode), 2) if decode else None,
        "decode_p90_ms": round(percentile(decode, 0.9), 2) if decode else None,
        "decode_tokens_per_s": round(1000 / statistics.median(decode), 2) if decode else None,
        "concurrency": concurrency,
        "aggregate_tokens_per_s": round(concurrency * 1000 / statistics.median(decode), 2) if decode else None,
        "cached": [r.timings.cached for r in runs],
        "caches": {name: asdict(c.stats) for name, c in
                   (("vision", engine.vision_cache), ("prefix", engine.prefix_cache), ("answer", engine.answer_cache))},
    }


def format_report(r: dict) -> str:
    lines = [
        f"model       {r['model']}  ({r['weights']}, compute {r['dtype']}, {r['threads']} threads)",
        f"load        {r['load_s']:.2f} s      peak RSS {r['peak_rss_mb']:.0f} MB",
        f"prompt      {r['prompt_tokens']} tokens ({r['image_tokens']} image tokens)",
        f"vision      {r['vision_ms']:.0f} ms",
        f"prefill     {r['prefill_ms']:.0f} ms ({r['prefill_tokens_per_s']} tokens/s)",
        f"first token {r['ttft_ms']:.0f} ms",
    ]
    if r["decode_ms_per_token"]:
        lines.append(f"decode      {r['decode_ms_per_token']:.1f} ms/token median, {r['decode_p90_ms']:.1f} p90 "
                     f"({r['decode_tokens_per_s']} tokens/s)")
        if r["concurrency"] > 1:
            lines.append(f"together    {r['concurrency']} streams: {r['aggregate_tokens_per_s']} tokens/s in all")
    caches = ", ".join(f"{k} {v['hits']} hits/{v['misses']} misses" for k, v in r["caches"].items())
    lines.append(f"caches      {caches}")
    return "\n".join(lines)
