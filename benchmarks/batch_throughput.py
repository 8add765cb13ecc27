"""Items per minute of `qvl batch` at several batch sizes (decoding several items together
against one at a time); prints a markdown table (docs/batch.md shows one).

    python benchmarks/batch_throughput.py --model /work/ckpt/qvl-2b --images 8 --new-tokens 32

Every item decodes exactly --new-tokens tokens (greedy, EOS ignored) and the engine's caches
are off (each batch size answers the same images), so batch sizes compare like for like.
Rows go through the real path: parse, batched generation, fsynced JSONL writes. With
--repeats R the batch sizes run in R rounds, their order rotated each round; the fastest run
of each counts.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

import common
from qvl.batch.inputs import Item
from qvl.batch.output import ResultsFile
from qvl.batch.process import Worker
from qvl.engine import Engine, EngineOptions
from qvl.runtime import cpu_model
from qvl.sampling import SamplingParams
from qvl.tasks import get_task


def write_images(folder: Path, count: int, size: int) -> list[Item]:
    items = []
    for i in range(count):
        path = folder / f"img{i:03d}.png"
        pixels = np.random.RandomState(i).rand(size, size, 3) * 255
        Image.fromarray(pixels.astype("uint8")).save(path)
        items.append(Item(path.name, str(path)))
    return items


def measure(worker: Worker, items: list[Item], out: Path) -> float:
    """Seconds to answer `items` into a fresh results file."""
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    with ResultsFile(out) as results:
        for row in worker.rows(items):
            if "error" in row:
                raise RuntimeError(row["error"])
            results.write(row)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--image-size", type=int, default=448, help="square test images, in pixels")
    p.add_argument("--max-image-tokens", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto", help="auto | bf16 | fp32 | int8 | int4 (as qvl batch --weights)")
    p.add_argument("--threads", type=int)
    p.add_argument("--repeats", type=int, default=1, help="rounds over the batch sizes; the fastest run counts")
    args = p.parse_args()

    options = EngineOptions(model=args.model, dtype=args.dtype, weights=args.weights, threads=args.threads,
                            max_image_tokens=args.max_image_tokens, vision_cache_mb=0, prefix_cache_mb=0,
                            answer_cache_entries=0)
    engine = Engine.load(options)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    prompt = get_task("ocr").prompt
    with tempfile.TemporaryDirectory() as tmp:
        items = write_images(Path(tmp), args.images, args.image_size)
        image_tokens = engine.parse(Worker(engine, params, prompt, 1).request(items[0])).image_tokens
        measure(Worker(engine, params, prompt, 1), items[:1], Path(tmp) / "warmup.jsonl")
        print(f"model {engine.path.name} ({engine.weights} weights, {engine.runtime.dtype}, "
              f"{engine.runtime.threads} threads) on {cpu_model()}; "
              f"{args.images} images of {args.image_size}x{args.image_size} ({image_tokens} image tokens), "
              f"{args.new_tokens} new tokens each\n")
        sizes = [int(s) for s in args.batch_sizes.split(",")]
        print(f"| batch size | items/min | s/item | speedup vs {sizes[0]} |")
        print("|---:|---:|---:|---:|")
        runs = common.alternate({size: lambda size=size: measure(Worker(engine, params, prompt, size), items,
                                                                 Path(tmp) / "out.jsonl") for size in sizes},
                                args.repeats)
        base = min(runs[sizes[0]])
        for size in sizes:
            seconds = min(runs[size])
            print(f"| {size} | {args.images / seconds * 60:.1f} | {seconds / args.images:.2f} | "
                  f"{base / seconds:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
