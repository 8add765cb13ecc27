"""qvl's native kernels against torch's, one product at a time, in one process:

- decode GEMV (1 activation row) per weight format: GB/s of weights streamed, over 2B-shaped
  matrices (6144x2048) totalling more than the L3 cache;
- vision attention (16 heads, head_dim 64) at the default and the full image budget: TFLOP/s;
- decode attention (16 query heads over 8 KV heads, head_dim 128) at 2k cached positions;
- int8 x int8 GEMM (--int8-activations) against the bf16 GEMM, vision-MLP shape.

    python benchmarks/kernels.py
    QVL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/kernels.py   # a lower tier

Activations are bf16 on tiers with bf16 products, else float32 (what --dtype auto picks).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from compare import median_time  # benchmarks/compare.py (this script's folder is on sys.path)
from qvl.kernels import attention, build, linear
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan
from qvl.quantize import pack_nibbles, quantize_int4, quantize_int8


def gemv_rows(lib, repeat: int, count: int, dt: torch.dtype) -> list[tuple[str, float, float]]:
    n, k = 6144, 2048
    x = torch.randn(1, k).to(dt)
    w = torch.randn(n, k)
    q8, s8 = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w, 128)
    bf = [w.bfloat16().clone() for _ in range(count)]
    i8 = [q8.clone() for _ in range(count)]
    i4 = [pack_nibbles(q4) for _ in range(count)]
    s8, s4, z4 = s8.to(dt), s4.to(dt), z4.to(dt)
    rows = []

    def rate(run, mats, nbytes):
        return nbytes * len(mats) / median_time(lambda: [run(m) for m in mats], repeat) / 1e9

    rows.append(("bf16", rate(lambda m: linear.gemv(lib, build.W_BF16, x, m, n), bf, n * k * 2),
                 rate(lambda m: F.linear(x, m.to(dt)), bf, n * k * 2)))
    rows.append(("int8", rate(lambda m: linear.gemv(lib, build.W_INT8, x, m, n, s8), i8, n * k),
                 rate(lambda m: torch._weight_int8pack_mm(x, m, s8), i8, n * k)))
    packed = [torch._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1) for _ in range(count)]
    sz = torch.stack([s4.t(), z4.t()], -1).contiguous()
    rows.append(("int4 (g128)", rate(lambda m: linear.gemv(lib, build.W_INT4, x, m, n, s4, z4, 128), i4, n * k // 2),
                 rate(lambda m: torch._weight_int4pack_mm_for_cpu(x, m, 128, sz), packed, n * k // 2)))
    return rows


def attention_rows(lib, repeat: int, dt: torch.dtype) -> list[tuple[str, float, float]]:
    rows = []
    flash = default_plan(torch.bfloat16).prefill_attention == "qvl_attention"
    for patches in (1008, 8160) if flash else ():  # 1920x1080 at the default 252 tokens, and at the full 2040
        q, k, v = (torch.randn(patches, 16, 64).bfloat16() for _ in range(3))
        flops = 4 * 16 * patches**2 * 64
        ours = median_time(lambda: attention.attention(lib, q, k, v), repeat)
        heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, S, D]: SDPA's fused 4-D path
        sdpa = median_time(lambda: F.scaled_dot_product_attention(*heads_first), repeat)
        rows.append((f"vision attention, {patches} patches (TFLOP/s)", flops / ours / 1e12, flops / sdpa / 1e12))
    cache_k, cache_v = torch.randn(1, 8, 4096, 128).to(dt), torch.randn(1, 8, 4096, 128).to(dt)
    keys, values, q = cache_k[:, :, :2048], cache_v[:, :, :2048], torch.randn(1, 16, 1, 128).to(dt)
    ours = median_time(lambda: attention.decode_attention(lib, q, keys, values, None), repeat * 20) * 1e3
    sdpa = median_time(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True), repeat * 20) * 1e3
    rows.append(("decode attention, 2048 positions (ms per layer)", ours, sdpa))
    return rows


def int8_gemm_row(lib, repeat: int, dt: torch.dtype) -> tuple[str, float, float]:
    m, k, n = 1008, 1024, 4096
    x, w = torch.randn(m, k).to(dt), torch.randn(n, k)
    q, s = quantize_int8(w)
    s = s.to(dt)
    dense = (q.float() * s.float()[:, None]).to(dt)
    ours = median_time(lambda: linear.int8_matmul(lib, x, q, s), repeat)
    bf16 = median_time(lambda: F.linear(x, dense), repeat)
    flops = 2 * m * k * n
    return (f"int8 x int8 GEMM (--int8-activations) vs {str(dt)[6:]} GEMM, 1008x1024x4096 (TFLOP/s)",
            flops / ours / 1e12,
            flops / bf16 / 1e12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--matrices", type=int, default=32, help="distinct weight matrices per GEMV pass (> L3)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib, dt = library().lib, torch.bfloat16 if library().tier.bf16 else torch.float32
    if lib is None:
        raise SystemExit("the native kernels are not available here")
    print(f"{args.threads} threads, {dt} activations; kernels: {library().describe()}\n")
    print("| decode GEMV, 1 row, 6144x2048 | qvl GB/s | torch GB/s | ratio |\n|---|---|---|---|")
    for name, ours, theirs in gemv_rows(lib, args.repeat, args.matrices, dt):
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
    print("\n| product | qvl | torch | ratio |\n|---|---|---|---|")
    for name, ours, theirs in attention_rows(lib, args.repeat, dt):
        better = theirs / ours if "ms" in name else ours / theirs
        print(f"| {name} | {ours:.3f} | {theirs:.3f} | {better:.2f}× |")
    name, ours, theirs = int8_gemm_row(lib, args.repeat, dt)
    print(f"| {name} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}× |")


if __name__ == "__main__":
    main()
