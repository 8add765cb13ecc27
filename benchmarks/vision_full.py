"""The vision encoder at the full budget (1920x1080, 2,040 tokens, 8,160 patches):
transformers bf16 against qvl, both loaded in one process and run alternately, so that both
sides see the same machine state (this VM's speed drifts between runs); medians of --repeat.

    python benchmarks/vision_full.py --model /work/ckpt/qvl-2b --repeat 3
    python benchmarks/vision_full.py --model /work/ckpt/qvl-8b-8layers --tokens 256 --configs default

--tokens sets the budget (default the full 2,040); --configs default runs qvl's default
configuration (int8, the vision tower as the tier decides) instead of the two above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from qvl.bench import synthetic_image
from qvl.engine import Engine, EngineOptions
from qvl.processing.image import max_pixels_for_tokens, preprocess

CONFIGS = {
    "qvl bf16": {"weights": "bf16"},
    "qvl int8-fast (--vision-int8 --int8-activations)": {"weights": "int8", "vision_int8": True,
                                                         "int8_activations": "all"},
}
DEFAULT = {"qvl default (int8)": {}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2040, help="image tokens (the budget)")
    p.add_argument("--configs", choices=["formats", "default"], default="formats")
    args = p.parse_args()
    configs = DEFAULT if args.configs == "default" else CONFIGS
    torch.set_num_threads(args.threads)
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen3VLForConditionalGeneration.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    config = json.load(open(os.path.join(args.model, "preprocessor_config.json")))
    budget = args.tokens * 32 * 32
    proc = Qwen2VLImageProcessorPil(**{**config, "size": {"shortest_edge": 65536, "longest_edge": budget}})
    image = synthetic_image(1920, 1080)
    pixels = proc(images=[image], return_tensors="pt")
    engines = {name: Engine.load(EngineOptions(model=args.model, threads=args.threads, **changes))
               for name, changes in configs.items()}
    first = next(iter(engines.values()))
    processed = preprocess(image, first.image_cfg, max_pixels=max_pixels_for_tokens(args.tokens, first.image_cfg))
    patches = processed.pixel_values
    assert tuple(pixels["image_grid_thw"][0].tolist()) == processed.grid_thw, "both sides must see the same grid"

    runs = {"transformers bf16": lambda: reference.model.get_image_features(pixels["pixel_values"],
                                                                            pixels["image_grid_thw"])}
    for name, engine in engines.items():
        runs[name] = lambda engine=engine: engine.model.encode_images(patches, [processed.grid_thw])
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(args.repeat):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
                print(f"  {name}: {times[name][-1]:.3f} s", flush=True)
    base = statistics.median(times["transformers bf16"])
    print(f"\n{processed.grid_thw[1] * processed.grid_thw[2]} patches, {args.threads} threads, median of "
          f"{args.repeat} alternating runs\n\n| vision encoder, {args.tokens} tokens | seconds (runs) | speed-up |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} ({', '.join(f'{t:.3f}' for t in ts)}) | {base / med:.2f}× |")


if __name__ == "__main__":
    main()
