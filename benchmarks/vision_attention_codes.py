"""Do integer products in the vision tower's attention keep its accuracy? Measured with qvl's
kernels where the tier has them ("the defaults": qvl_attention_i16, float32 compute, 16-bit
codes, on AVX2 and AVX-512 without bf16; qvl_attention_q8, bf16 compute, 8-bit codes for scores, P and V, on
AVX-512 with VNNI and BF16), against the same tower without them (bf16 flash kernel or SDPA), and
simulated in float for 8-bit schemes: SageAttention-style int8 QK^T (keys minus their mean over the image's
patches, exact for softmax; int8 codes of q and k with one step per token and head, or per 64
tokens and head), optionally P as unsigned 8-bit codes per query row and V as int8 per channel,
or both with a step per run of 64 keys (what a blocked kernel could apply per key block);
softmax and everything else as the defaults. Mean per-row cosine of the image features
(merged + DeepStack) and of the prompt logits against bf16 weights, top-1 agreement against bf16
weights and against the defaults; "keys centred" is the float control (how far float rounding
alone moves the scores).

    python benchmarks/vision_attention_codes.py --model /work/ckpt/qvl-2b-outliers --max-image-tokens 256
    python benchmarks/vision_attention_codes.py --model /work/ckpt/qvl-2b-outliers --max-image-tokens 1024
    python benchmarks/vision_attention_codes.py ... --kernels-only    # without the simulated schemes
(at 1024 tokens the images are 1920x1080 and 1280x960: 4,032 and 4,800 patches)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from int8_activations import PROMPTS, eval_sizes, row_cosine, run, samples, top1
from qvl.engine import Engine, EngineOptions
from qvl.kernels import ops


def dequantised_codes(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [n, H, hd] float32 -> its int8 codes times their steps: one step per (token, head), or
    per (block of tokens, head) when block > 0."""
    n = x.shape[0]
    if block == 0:
        amax = x.abs().amax(-1, keepdim=True)
    else:
        padded = F.pad(x, (0, 0, 0, 0, 0, (-n) % block))
        amax = padded.view(-1, block, *x.shape[1:]).abs().amax(dim=(1, 3), keepdim=True)
        amax = amax.expand(-1, block, -1, 1).reshape(-1, x.shape[1], 1)[:n]
    step = amax / 127
    return torch.where(step > 0, torch.round(x / step), torch.zeros_like(x)) * step


def block_codes(x: torch.Tensor, dim: int, block: int, levels: int) -> torch.Tensor:
    """x's codes times their steps, one step (max |x| / levels) per run of `block` entries along
    `dim` (and per index of every other dim)."""
    n = x.shape[dim]
    moved = x.movedim(dim, -1)
    padded = F.pad(moved, (0, (-n) % block))
    groups = padded.reshape(*padded.shape[:-1], -1, block)
    step = groups.abs().amax(-1, keepdim=True) / levels
    coded = torch.where(step > 0, torch.round(groups / step) * step, torch.zeros_like(groups))
    return coded.reshape(padded.shape)[..., :n].movedim(-1, dim)


def attention(block: int | None, pv_codes: bool = False, pv_block: int = 0):
    """An image_attention replacement: q, k, v [n, H, hd] -> [n, H, hd]. pv_block > 0: P in
    unsigned 8-bit codes with a step per query row and run of pv_block keys (the block's
    largest probability / 255), V in int8 with a step per channel and run of pv_block tokens."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qf, kf = q.float(), k.float()
        kf = kf - kf.mean(0, keepdim=True)  # q . mean(k) is one constant per query row
        if block is not None:
            qf, kf = dequantised_codes(qf, block), dequantised_codes(kf, block)
        p = (torch.einsum("nhd,mhd->hnm", qf, kf) / q.shape[-1] ** 0.5).softmax(-1).to(v.dtype).float()
        vf = v.float()
        if pv_block:
            p = block_codes(p, -1, pv_block, 255)
            vf = block_codes(vf, 0, pv_block, 127).to(v.dtype).float()
        elif pv_codes:
            ps = p.amax(-1, keepdim=True) / 255
            p = torch.round(p / ps) * ps
            vs = vf.abs().amax(0, keepdim=True) / 127
            vf = (torch.round(vf / vs) * vs).to(v.dtype).float()
        return torch.einsum("hnm,mhd->nhd", p, vf).to(q.dtype)
    return attend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--max-image-tokens", type=int, default=256)
    p.add_argument("--kernels-only", action="store_true", help="qvl's kernels only, not the simulated schemes")
    args = p.parse_args()
    sizes = eval_sizes(3) if args.max_image_tokens < 1024 else [(1920, 1080), (1280, 960)]
    requests = samples(sizes, PROMPTS, 0, args.max_image_tokens)
    bf16 = Engine.load(EngineOptions(model=args.model, weights="bf16", threads=2))
    ref = run(bf16, requests)
    del bf16
    engine = Engine.load(EngineOptions(model=args.model, threads=2))
    base = run(engine, requests)
    print(f"{args.model}, {args.max_image_tokens} image tokens, images {sizes}\n")
    print("| vision attention | features cos vs bf16 | logits cos vs bf16 | top-1 vs bf16 | top-1 vs the defaults |")
    print("|---|---|---|---|---|")
    print(f"| the defaults | {row_cosine(base.features, ref.features)[0]:.5f} | "
          f"{row_cosine(base.logits, ref.logits)[0]:.5f} | {top1(base.logits, ref.logits):.3f} | - |")
    original = (ops.image_attention, ops.byte_image_attention, ops.integer_image_attention)

    def float_path(q, k, v, cos, sin):  # what the tower runs without the 16-bit integer kernel
        return ops.image_attention(ops.vision_rotary(q, cos, sin), ops.vision_rotary(k, cos, sin), v)

    def everywhere(attend):  # (image, byte-score, 16-bit) attention all through `attend`
        return attend, attend, float_path

    variants = (("bf16 flash kernel or SDPA in the compute dtype (no integer products)", everywhere(original[0])),
                ("qvl's integer kernels where the tier has them (the defaults)", original),
                ("float, keys centred (control)", everywhere(attention(None))),
                ("int8 QK, a step per token", everywhere(attention(0))),
                ("int8 QK, a step per 64 tokens", everywhere(attention(64))),
                ("int8 QK per 64 tokens + 8-bit P and V", everywhere(attention(64, pv_codes=True))),
                ("int8 QK per 64 tokens + 8-bit P and V per 64 keys", everywhere(attention(64, pv_block=64))))
    for name, (image, byte, integer) in variants[:2] if args.kernels_only else variants:
        ops.image_attention, ops.byte_image_attention, ops.integer_image_attention = image, byte, integer
        try:
            out = run(engine, requests)
        finally:
            ops.image_attention, ops.byte_image_attention, ops.integer_image_attention = original
        print(f"| {name} | {row_cosine(out.features, ref.features)[0]:.5f} | {row_cosine(out.logits, ref.logits)[0]:.5f} | "
              f"{top1(out.logits, ref.logits):.3f} | {top1(out.logits, base.logits):.3f} |", flush=True)


if __name__ == "__main__":
    main()
