"""int8 / int4 against bf16 on a fixed prompt set: top-1 agreement of the next-token
logits along bf16's own greedy continuation (teacher-forced), and logit cosine.

    python benchmarks/quality.py --model /work/ckpt/qvl-2b
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from qvl.bench import synthetic_image
from qvl.engine import Engine, EngineOptions, Request
from qvl.generate import PreparedPrompt, new_cache, prefill
from qvl.sampling import SamplingParams
from qvl.stream import Timings

PROMPTS = [
    ("text", "Explain in two sentences why the sky is blue."),
    ("text", "请用中文介绍一下长城。"),
    ("text", "Write a Python function that reverses a string."),
    ("image", "Describe this image in detail."),
    ("image", "Read all the text in this image, line by line."),
]


FORMATS = {  # every prompt position runs through prefill: int8 activations apply to all of them
    "int8": {"weights": "int8"},
    "int8 --vision-int8 --int8-activations": {"weights": "int8", "vision_int8": True, "int8_activations": "all"},
    "int4 (group 128)": {"weights": "int4"},
    "int4 --vision-int8": {"weights": "int4", "vision_int8": True},
}


def request(kind: str, text: str, n: int) -> Request:
    content = ([{"type": "image", "image": synthetic_image(640, 480, seed=len(text))}] if kind == "image" else []) + [
        {"type": "text", "text": text}]
    return Request([{"role": "user", "content": content}], SamplingParams(temperature=0, max_new_tokens=n,
                                                                         ignore_eos=True), max_image_tokens=256)


@torch.inference_mode()
def all_logits(engine: Engine, req: Request, continuation: list[int]) -> torch.Tensor:
    """Logits at each position of prompt + continuation[:-1] that predicts a continuation token."""
    parsed = engine.parse(req)
    prompt = engine.prepare(parsed, Timings())
    out = []
    ids, positions = prompt.ids, prompt.positions
    for i, token in enumerate(continuation):  # one position at a time through the same prefill path
        p = PreparedPrompt(ids, positions, 0, prompt.image_embeds, prompt.deepstack)
        out.append(prefill(engine.model, new_cache(engine.model, 1, len(p)), p))
        ids = torch.cat([ids, torch.tensor([token])])
        positions = torch.cat([positions, torch.full((3, 1), prompt.next_position + i)], 1)
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    options = EngineOptions(model=args.model, threads=2, vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0)
    reference = Engine.load(EngineOptions(**{**options.__dict__, "weights": "bf16"}))
    runs = [(kind, text, reference.generate(request(kind, text, args.tokens)).token_ids) for kind, text in PROMPTS]
    ref_logits = [all_logits(reference, request(k, t, args.tokens), c) for k, t, c in runs]
    del reference
    print("| weights | top-1 agreement with bf16 | mean logit cosine |\n|---|---|---|")
    for name, changes in FORMATS.items():
        engine = Engine.load(EngineOptions(**{**options.__dict__, **changes}))
        agree = total = 0
        cosines = []
        for (kind, text, cont), ref in zip(runs, ref_logits):
            logits = all_logits(engine, request(kind, text, args.tokens), cont)
            agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            total += len(cont)
            cosines.append(F.cosine_similarity(logits, ref, dim=-1).mean().item())
        print(f"| {name} | {agree}/{total} = {agree / total:.1%} | {sum(cosines) / len(cosines):.4f} |", flush=True)
        del engine


if __name__ == "__main__":
    main()
