"""Every kernel tier this machine can run (AVX-512, AVX-512 without BF16, AVX2 with and
without AVX-VNNI, portable C), each built as its own library, against float references; the
kernel plan per tier; the cache folder's fallback; importing without fcntl."""

from __future__ import annotations

import dataclasses

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qvl import paths
from qvl.kernels import attention, build, elementwise, linear
from qvl.kernels.library import Library, library
from qvl.kernels.plan import Plan
from qvl.quantize import pack_nibbles, quantize_int4, quantize_int8

TIERS = build.tiers() if build.compiler() else []
pytestmark = pytest.mark.skipif(not TIERS, reason="no C compiler")
RUNS = build.select_tier().name if TIERS else None  # the tier qvl runs here: the other tiers' builds are slow


def built(tier: build.Tier):
    """The tier's kernels, kept in qvl's own folder: built once, shared with the engine's own build."""
    return build.load(tier, paths.cache_root() / "native")


@pytest.fixture(scope="module", params=[pytest.param(t.name, marks=() if t.name == RUNS else pytest.mark.slow)
                                        for t in TIERS])
def tier_lib(request):
    tier = next(t for t in TIERS if t.name == request.param)
    return tier, built(tier)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _int4_reference(x: torch.Tensor, q4: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, gs: int,
                    bias: torch.Tensor) -> torch.Tensor:
    """The integer int4 scheme in float64: x [M, K] rounded to int8 per 128 columns (ties away
    from zero), integer sums per group, w = (q - 8) * scale + zero."""
    m, k = x.shape
    chunks = x.view(m, -1, 128)
    step = chunks.abs().amax(-1, keepdim=True) / 127
    v = chunks * (1 / step)
    unit = min(gs, 128)  # the columns of one integer sum: a group within one activation chunk
    xq = (v.sign() * (v.abs() + 0.5).floor()).view(m, -1, unit).double()
    dots = torch.einsum("mui,nui->mnu", xq, q4.double().view(q4.shape[0], -1, unit))
    act = step.double().view(m, -1).repeat_interleave(128 // unit, 1)
    ints = (dots * act[:, None, :] * scale.double().repeat_interleave(gs // unit, 1)[None]).sum(-1)
    zeros = (x.double().view(m, -1, gs).sum(-1)[:, None, :] * (zero.double() - 8 * scale.double())[None]).sum(-1)
    return ints + zeros + bias.double()


def test_int4_gemv_exact_scheme(tier_lib):
    """int4 with the integer path: the same quantised activations on every tier (only float
    sums in another order), weight rows not a multiple of the kernels' four, and a bias; 8 rows
    take weight rows in pairs on AVX-512. A row's output is bit-identical whatever rows share its
    call (the scheduler relies on it)."""
    tier, lib = tier_lib
    torch.manual_seed(0)
    for m in (1, 2, 5, 8):
        x, w, bias = torch.randn(m, 512), torch.randn(7, 512), torch.randn(7)
        for gs in (32, 64, 128, 256):
            q4, s4, z4 = quantize_int4(w, gs)
            out = linear.gemv(lib, build.W_INT4, x, pack_nibbles(q4), 7, s4, z4, gs, bias)
            ref = _int4_reference(x, q4, s4, z4, gs, bias)
            torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=1e-4, msg=f"{tier.name} m={m} gs={gs}")
            if m == 8:
                for rows in (1, 4, 5):
                    alone = linear.gemv(lib, build.W_INT4, x[:rows], pack_nibbles(q4), 7, s4, z4, gs, bias)
                    assert torch.equal(alone, out[:rows]), (tier.name, gs, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_every_format(tier_lib, dtype):
    """int8 keeps 16 bits per activation (error far below bf16's); int4 quantises
    activations to int8 per 128 columns (a few % of the largest output); bf16 weights are
    exact float products. Rows 1..5 cover every tile size; K=320 the non-integer fallback."""
    tier, lib = tier_lib
    torch.manual_seed(0)
    bound = 2e-4 if dtype == torch.float32 else 8e-3  # bf16 outputs are rounded to bf16
    for m in (1, 2, 3, 4, 5):
        x, w = torch.randn(m, 512).to(dtype), torch.randn(96, 512)
        q, s = quantize_int8(w)
        ref = F.linear(x.float(), q.float() * s.to(dtype).float()[:, None])
        assert _rel_err(linear.gemv(lib, build.W_INT8, x, q, 96, s.to(dtype)), ref) < bound, (tier, m)
        for gs in (32, 64, 128, 256):
            q4, s4, z4 = quantize_int4(w, gs)
            s4, z4 = s4.to(dtype), z4.to(dtype)
            deq = ((q4.float() - 8).view(96, -1, gs) * s4.float()[..., None] + z4.float()[..., None]).view(96, 512)
            out, ref = linear.gemv(lib, build.W_INT4, x, pack_nibbles(q4), 96, s4, z4, gs), F.linear(x.float(), deq)
            assert _rel_err(out, ref) < 5e-2 and F.cosine_similarity(out.float().flatten(), ref.flatten(), 0) > 0.999

            back = linear.dequantize(lib, build.W_INT4, pack_nibbles(q4), s4, z4, gs, (96, 512))
            torch.testing.assert_close(back.float(), deq, atol=2e-2, rtol=1e-2)
        wb, bias = w.bfloat16(), torch.randn(96).to(dtype)
        ref = F.linear(x.float(), wb.float(), bias.float())
        assert _rel_err(linear.gemv(lib, build.W_BF16, x, wb, 96, bias=bias), ref) < bound, (tier, m)
    x, w = torch.randn(4, 512).to(dtype), torch.randn(96, 512)  # int4: a NaN or infinity gives its row NaN
    q4, s4, z4 = quantize_int4(w, 64)
    args = (pack_nibbles(q4), 96, s4.to(dtype), z4.to(dtype), 64)
    clean = linear.gemv(lib, build.W_INT4, x, *args)
    x[1, 3], x[2, -1] = float("nan"), float("inf")
    poisoned = linear.gemv(lib, build.W_INT4, x, *args)
    assert poisoned[1:3].isnan().all() and torch.equal(poisoned[[0, 3]], clean[[0, 3]]), tier.name
    x, w = torch.randn(3, 320).to(dtype), torch.randn(40, 320)  # K not a multiple of 128: float products
    q, s = quantize_int8(w)
    ref = F.linear(x.float(), q.float() * s.to(dtype).float()[:, None])
    assert _rel_err(linear.gemv(lib, build.W_INT8, x, q, 40, s.to(dtype)), ref) < bound


def _int8_q16_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The int8 GEMV's scheme in float64: activations rounded (half away from zero) to 16 bits
    per 128 columns, exact integer sums per chunk, scaled per chunk and per weight row."""
    m, n = x.shape[0], q.shape[0]
    chunks = x.float().view(m, -1, 128)
    amax = chunks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 32767, torch.ones_like(amax))  # float32, as the kernel
    v = chunks * (1 / scale)
    codes = (torch.sign(v) * torch.floor(v.abs() + 0.5)).double()
    sums = torch.einsum("mck,nck->mnc", codes, q.double().view(n, -1, 128))
    return (sums * scale[..., 0].double()[:, None, :]).sum(-1) * s.double() + bias.double()


@pytest.mark.parametrize("k", [1024, 6144])
def test_int8_gemv_exact_scheme_and_rows_independent(tier_lib, k):
    """Every tier (AMX tiles included, 16 weight rows at a time with a tail of 5 here; from 2
    activation rows on, AVX-512 VNNI three weight rows at a time (two for a tile of 1-2 rows)
    and plain AVX2 pairs, with rows left over in each thread's share here) gives the
    scheme's result up to float rounding, for 1 to 17 rows, and a row's output is bit-identical
    whatever rows share its call: the scheduler relies on it (answers never depend on what
    else ran). At 6,144 inputs x86 takes a tile's columns in ranges (its codes would not fit
    L1), carrying each product's sums over: still the same bits."""
    tier, lib = tier_lib
    torch.manual_seed(3)
    n = 101
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s, bias = torch.rand(n) / 50, torch.randn(n)
    x = torch.randn(17, k)
    x[0, :128] *= 1e4  # a chunk whose codes reach +-32767 (both bytes of the AMX split in use)
    x[1, 128:256] = 0.0  # an all-zero chunk
    ref = _int8_q16_reference(x, q, s, bias)
    for m in (1, 2, 7, 16, 17):
        out = linear.gemv(lib, build.W_INT8, x[:m], q, n, s, bias=bias)
        err = ((out.double() - ref[:m]).abs() / ref[:m].abs().amax(1, keepdim=True)).max().item()
        assert err < 1e-6, (tier.name, m, err)  # float32 sums of exact chunk sums: ~1.5e-7 measured
    together = linear.gemv(lib, build.W_INT8, x, q, n, s, bias=bias)
    for i in (0, 5, 16):
        alone = linear.gemv(lib, build.W_INT8, x[i : i + 1], q, n, s, bias=bias)
        assert torch.equal(alone[0], together[i]), (tier.name, i)
    threads = torch.get_num_threads()
    try:  # each thread takes an equal share of the weight rows: 1 or 3 shares, the same bits
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(linear.gemv(lib, build.W_INT8, x, q, n, s, bias=bias), together), (tier.name, t)
    finally:
        torch.set_num_threads(threads)
    x[3, 7] = float("nan")  # a NaN or infinity gives its own row NaN and leaves the others' bits alone
    x[4, -1] = float("inf")
    poisoned = linear.gemv(lib, build.W_INT8, x, q, n, s, bias=bias)
    assert poisoned[3].isnan().all() and not poisoned[4].isfinite().any(), tier.name
    keep = [i for i in range(17) if i not in (3, 4)]
    assert torch.equal(poisoned[keep], together[keep]), tier.name


def test_decode_gemv_bits_do_not_depend_on_the_threads(tier_lib):
    """The decode GEMVs (int8, int4, bf16 weights) split the weight rows into a share per
    thread, taken block by block, and a thread done with its share takes blocks from the end of
    another's: whatever the thread count (more threads than cores: threads wait, others take
    over their blocks) and rows that are not a multiple of any block, every row is computed
    once and comes out the same bits."""
    tier, lib = tier_lib
    torch.manual_seed(5)
    n, k = 1001, 512
    x = torch.randn(8, k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s, bias = torch.rand(n) / 50, torch.randn(n)
    q4, s4, z4 = quantize_int4(torch.randn(n, k), 64)
    wb = torch.randn(n, k).bfloat16().float()
    products = {
        "int8": lambda rows: linear.gemv(lib, build.W_INT8, rows, q, n, s, bias=bias),
        "int4": lambda rows: linear.gemv(lib, build.W_INT4, rows, pack_nibbles(q4), n, s4, z4, 64, bias),
        "bf16": lambda rows: linear.gemv(lib, build.W_BF16, rows, wb.bfloat16(), n, bias=bias),
    }
    threads = torch.get_num_threads()
    try:
        for name, product in products.items():
            for m in (1, 8):
                torch.set_num_threads(1)
                alone = product(x[:m])
                assert alone.isfinite().all(), (tier.name, name, m)
                for t in (2, 3, 8):
                    torch.set_num_threads(t)
                    for _ in range(3):
                        assert torch.equal(product(x[:m]), alone), (tier.name, name, m, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # builds every tier's library
def test_amx_int8_tiles_only_where_the_tier_has_them():
    """The default build of an AMX CPU takes int8 products on AMX tiles; a tier run as a CPU
    without them (avx512-noamx, the lower tiers) does not."""
    for tier in TIERS:
        features = built(tier).qvl_features()
        expected = tier.amx and "amx_int8" in build.cpu_flags() and tier.name == "avx512"
        assert bool(features & build.AMX_INT8) == expected, tier.name


@pytest.mark.slow  # builds every tier's library
def test_integer_products_agree_across_tiers():
    """The tiers quantise activations the same way: they differ only in the order of float sums."""
    torch.manual_seed(1)
    x, w = torch.randn(3, 1024), torch.randn(64, 1024)
    q, s = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w, 64)
    outs = []
    for tier in TIERS:
        lib = built(tier)
        outs.append((tier.name, linear.gemv(lib, build.W_INT8, x, q, 64, s),
                     linear.gemv(lib, build.W_INT4, x, pack_nibbles(q4), 64, s4, z4, 64)))
    for name, o8, o4 in outs[1:]:
        torch.testing.assert_close(o8, outs[0][1], atol=1e-4, rtol=1e-5, msg=name)
        torch.testing.assert_close(o4, outs[0][2], atol=1e-4, rtol=1e-5, msg=name)


def _reference_decode_attention(q, keys, values, length):
    """q [B, H, D] over the first `length` of keys/values [B, Hkv, L, D] (GQA), in float."""
    keys, values = keys[:, :, :length].float(), values[:, :, :length].float()
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys.repeat_interleave(q.shape[1] // keys.shape[1], 1))
    p = (scores / q.shape[-1] ** 0.5).softmax(-1)
    return torch.einsum("bhl,bhld->bhd", p, values.repeat_interleave(q.shape[1] // keys.shape[1], 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(tier_lib, dtype):
    """Rows of different lengths, read through their block tables (blocks anywhere in the pool)."""
    from qvl.kv_cache import BLOCK

    tier, lib = tier_lib
    torch.manual_seed(2)
    b, h, hkv, d = 2, 8, 2, 128
    q = torch.randn(b, h, 1, d).to(dtype)
    pool_k, pool_v = torch.randn(9, hkv, BLOCK, d).to(dtype), torch.randn(9, hkv, BLOCK, d).to(dtype)
    table, lengths = torch.tensor([[7, 2, 5], [4, -1, -1]]), torch.tensor([33, 7])
    out = attention.decode_attention(lib, q, pool_k, pool_v, table, lengths)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lengths.tolist()):
        blocks = table[i][table[i] >= 0]
        cache_k, cache_v = (x[blocks].transpose(0, 1).flatten(1, 2)[None] for x in (pool_k, pool_v))
        ref = _reference_decode_attention(q[i : i + 1, :, 0], cache_k, cache_v, n)
        torch.testing.assert_close(out[i : i + 1, :, 0].float(), ref, atol=tol, rtol=tol, msg=tier.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(tier_lib, dtype):
    tier, lib = tier_lib
    x, w = torch.randn(70, 256).to(dtype), torch.rand(256).to(dtype) + 0.5
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(elementwise.rms_norm(lib, x, w, 1e-6), ref, atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_int8_activation_matmul(tier_lib):
    """--int8-activations: activations quantised per row around oneDNN's int8 GEMM, GELU fused
    (in the codes this process's oneDNN sums exactly: 8-bit with VNNI, 7-bit with vpmaddubsw)."""
    tier, lib = tier_lib
    levels = library().int8_levels
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(40, 256).to(dtype), torch.randint(-127, 128, (96, 256), dtype=torch.int8)
        scale, bias = (torch.rand(96) / 50).to(dtype), torch.randn(96).to(dtype)
        ref = F.linear(x.float(), w.float() * scale.float()[:, None], bias.float())
        packed, colsums = linear.pack_int8(w), w.sum(1, dtype=torch.int32).float()
        out = linear.int8_matmul(lib, x, packed, colsums, scale, bias, levels)
        assert F.cosine_similarity(out.float().flatten(), ref.flatten(), 0) > (0.999 if levels == 255 else 0.997), tier.name
        fused = linear.int8_matmul(lib, x, packed, colsums, scale, bias, levels, gelu_tanh=True)
        torch.testing.assert_close(fused.float(), F.gelu(out.float(), approximate="tanh"), atol=2e-2, rtol=1e-2)
        norm_w, norm_b = (torch.rand(256) + 0.5).to(dtype), torch.randn(256).to(dtype)  # the LayerNorm before it, fused
        normed = linear.int8_matmul(lib, x, packed, colsums, scale, bias, levels, layer_norm=(norm_w, norm_b, 1e-6))
        apart = linear.int8_matmul(lib, F.layer_norm(x, (256,), norm_w, norm_b, 1e-6), packed, colsums, scale, bias, levels)
        torch.testing.assert_close(normed.float(), apart.float(), atol=2e-2 * apart.abs().max().item(), rtol=0)
        residual = torch.randn(40, 96).to(dtype)  # and the residual add after it
        added = linear.int8_matmul(lib, x, packed, colsums, scale, bias, levels, residual=residual)
        torch.testing.assert_close(added, residual + out, atol=0, rtol=0)
        if lib.features & build.AMX_INT8:  # the AMX kernel, where the tier has the tiles: the same bits
            tiles = linear.amx_pack_int8(lib, w)
            assert torch.equal(linear.int8_matmul(lib, x, tiles, colsums, scale, bias, levels, amx=True), out), tier.name


def _code_bound(x: torch.Tensor, w: torch.Tensor, group: int, top: int) -> torch.Tensor:
    """[M, N]: the rounding of symmetric codes (step max|x| / top per `group` columns): half a
    step per term, in float64."""
    m, k = x.shape
    chunks = (k + group - 1) // group
    padded = F.pad(x.double().abs(), (0, chunks * group - k)).view(m, chunks, group)
    steps = padded.amax(-1) / top  # [M, chunks]
    weights = F.pad(w.double().abs(), (0, chunks * group - k)).view(w.shape[0], chunks, group).sum(-1)  # [N, chunks]
    return steps @ weights.T / 2


# (kernel, activation codes: columns per step or 0 for a row, top code of the build (0: the kernel
# is not built), shapes (rows, K, N))
PREFILL_KERNELS = {
    "16-bit codes per row": (lambda lib, *a: linear.i16_linear(lib, *a), 0,
                             lambda lib: 32767 if lib.features & build.AVX2 else 0,
                             ((29, 600, 48), (1, 64, 16), (13, 2050, 272))),
    # 8-bit codes with VNNI (vpdpbusd), 7-bit on plain AVX2 (vpmaddubsw)
    "byte codes per 64 columns": (lambda lib, *a: linear.q8_linear(lib, *a), 64, lambda lib: lib.q8_levels,
                                  ((29, 600, 48), (1, 64, 16), (13, 2052, 272), (600, 4096, 16))),  # 2 chunks of rows
    "byte codes per 128 columns": (lambda lib, *a: linear.q8_linear(lib, *a, group=128), 128,
                                   lambda lib: lib.q8_levels, ((21, 1000, 64),)),
}


@pytest.mark.parametrize("codes", PREFILL_KERNELS)
def test_prefill_int8_products(tier_lib, codes):
    """Prefill's int8 products on the x86 tiers without AMX (prefill_gemm.c): activation rows in
    16-bit codes (exact integer pair sums), or in byte codes per group of columns (exact integer
    byte sums per group, each scaled by its step): 8-bit with VNNI, 7-bit on plain AVX2, whose
    vpmaddubsw would saturate its 16-bit pair sums on 8-bit ones. Within the codes' rounding
    (half a step per term) of the exact product even with an outlier 300x the rest, over
    shapes with tails (rows, a 16-column block, inputs past whole panels and groups); a zero
    row gives the bias; a row's result is bit for bit the same alone, among others and on 1 or
    2 threads; the tiers without the kernel say None."""
    tier, lib = tier_lib
    kernel, group, top_of, shapes = PREFILL_KERNELS[codes]
    top = top_of(lib)
    torch.manual_seed(4)
    for rows, k_in, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            q, s = quantize_int8(torch.randn(n, k_in))
            s, bias = s.to(dtype), torch.randn(n).to(dtype)
            x = torch.randn(rows, k_in).to(dtype)
            x[0, 5] = 300.0  # a massive activation
            if rows > 2:
                x[2] = 0
            y = kernel(lib, x, q, s, bias)
            if not top:
                assert y is None
                return
            ws = q.double() * s.double()[:, None]
            exact = x.double() @ ws.T + bias.double()
            bound = (_code_bound(x, ws, group or k_in, top) + 2**-20 * (x.double().abs() @ ws.abs().T)
                     + (2**-8 * exact.abs() if dtype == torch.bfloat16 else 0))
            assert y.dtype == dtype and y.shape == (rows, n)
            assert ((y.double() - exact).abs() <= bound).all(), (tier.name, rows, dtype)
            if rows > 2:
                assert torch.equal(y[2], bias)
            for r in (0, rows - 1):
                assert torch.equal(kernel(lib, x[r : r + 1], q, s, bias), y[r : r + 1]), tier.name
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1 if threads > 1 else 2)
                assert torch.equal(kernel(lib, x, q, s, bias), y), tier.name
            finally:
                torch.set_num_threads(threads)
    bad = x.clone()
    bad[1, 7] = float("nan")  # a NaN is not hidden in a code of 0: its row comes out NaN
    assert kernel(lib, bad, q, s, bias)[1].isnan().all() and not kernel(lib, bad, q, s, None)[0].isnan().any()
    assert kernel(lib, x, q, s, bias[:-1].contiguous()) is None  # a bias of the wrong length
    assert kernel(lib, x[:, :-1].contiguous(), q[:, :-1].contiguous(), s, None) is None  # K odd
    assert kernel(lib, x, q[:8].contiguous(), s[:8], None) is None  # N % 16
    assert kernel(lib, x, q, s.double(), None) is None  # scales of another dtype than x
    if group:
        assert kernel(lib, x[:, :-2].contiguous(), q[:, :-2].contiguous(), s, None) is None  # K % 4
        assert linear.q8_linear(lib, x, q, s, bias, group=6) is None  # a group not a multiple of 4


def _coded_rows(x: torch.Tensor, group: int, top: int, fused: bool) -> torch.Tensor:
    """x [M, K] as the byte kernel codes it, in float64: per `group` columns symmetric codes
    x * (top / max|x|) rounded half away from zero (v + 0.5 truncated: in float32, or, `fused`,
    x * inv + 0.5 rounded once, as the compiler may contract it), times the step max|x| / top."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    peak = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(peak > 0, torch.full_like(peak, top) / peak, torch.zeros(()))  # a division, as in C
    v = xg.double() * inv.double() if fused else xg * inv  # float32 x float32 is exact in float64
    codes = torch.where(v >= 0, v + 0.5, v - 0.5).float().trunc()
    return (codes.double() * (peak / top).double()).view(m, k)


def test_prefill_int4_products(tier_lib):
    """Prefill's int4 products in the byte kernel (qvl_q4_linear): the same 8-bit activation codes
    per 64 columns as int8's (127 levels on every build, plain AVX2's too: nibbles times codes
    never saturate its byte pairs), times the weights (q - 8) * scale + zero, unpacked from the
    nibbles: within float32 rounding of that scheme computed in float64, even with an outlier 300x
    the rest, over group sizes, tails of rows and a 16-column block, and two chunks of rows; a zero
    row gives the bias; a row's result is bit for bit the same alone, among others and on 1 or 2
    threads; a NaN turns only its row NaN; shapes it does not take say None, as do the tiers
    without the kernel."""
    tier, lib = tier_lib
    torch.manual_seed(5)
    for rows, k_in, n, gs in ((29, 512, 48, 128), (1, 256, 16, 64), (13, 2048, 272, 128), (40, 1024, 64, 256),
                              (600, 4096, 16, 128)):
        for dtype in (torch.float32, torch.bfloat16):
            q, s, z = quantize_int4(torch.randn(n, k_in), gs)
            nibbles, s, z, bias = pack_nibbles(q), s.to(dtype), z.to(dtype), torch.randn(n).to(dtype)
            x = torch.randn(rows, k_in).to(dtype)
            x[0, 5] = 300.0  # a massive activation
            if rows > 2:
                x[2] = 0
            y = linear.q4_linear(lib, x, nibbles, s, z, gs, bias)
            if not lib.q8_levels:
                assert y is None
                return
            scaled = (q.double() * s.double().repeat_interleave(gs, 1))  # [N, K]
            lowest = (z.double() - 8 * s.double()).repeat_interleave(gs, 1)
            coded, fused = (_coded_rows(x, linear.ACTIVATION_GROUP, 127, f) for f in (False, True))
            exact = coded @ (scaled + lowest).T + bias.double()
            bound = (2**-20 * (coded.abs() @ (scaled + lowest.abs()).T)  # float32 rounding
                     + (coded - fused).abs() @ (scaled + lowest).abs().T  # a tie's code either way
                     + (2**-8 * exact.abs() if dtype == torch.bfloat16 else 0))
            assert y.dtype == dtype and y.shape == (rows, n)
            assert ((y.double() - exact).abs() <= bound).all(), (tier.name, rows, k_in, gs, dtype)
            if rows > 2:
                assert torch.equal(y[2], bias)
            for r in (0, rows - 1):
                assert torch.equal(linear.q4_linear(lib, x[r : r + 1], nibbles, s, z, gs, bias), y[r : r + 1])
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1 if threads > 1 else 2)
                assert torch.equal(linear.q4_linear(lib, x, nibbles, s, z, gs, bias), y), tier.name
            finally:
                torch.set_num_threads(threads)
    bad = x.clone()
    bad[1, 7] = float("nan")
    out = linear.q4_linear(lib, bad, nibbles, s, z, gs)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert linear.q4_linear(lib, x, nibbles, s, z, gs, bias[:-1].contiguous()) is None  # a bias of the wrong length
    assert linear.q4_linear(lib, x, nibbles[:8].contiguous(), s[:8], z[:8], gs) is None  # N % 16
    assert linear.q4_linear(lib, x, nibbles, s.double(), z.double(), gs) is None  # scales of another dtype than x
    q, s, z = quantize_int4(torch.randn(n, k_in), 32)  # groups of 32: smaller than an activation group
    assert linear.q4_linear(lib, x, pack_nibbles(q), s.to(x.dtype), z.to(x.dtype), 32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_products_fuse_the_vision_blocks_norm_gelu_and_residual(tier_lib, dtype):
    """The vision tower's products in byte codes per group (qvl_q8_linear) take its blocks' layer
    norm (applied to each row as it is coded, as the module rounds it), tanh-GELU and residual
    add (applied as the result is written): the residual bit for bit as `residual + product`,
    the norm as the separate module (bit for bit in bf16, within float32 rounding of the
    moments in float32), the GELU within bf16's rounding of GELU after; a norm or residual of
    the wrong shape is refused."""
    tier, lib = tier_lib
    if not lib.q8_levels:
        pytest.skip(f"{tier.name} has no byte products")
    torch.manual_seed(5)
    rows, k_in, n = 37, 320, 96
    q, s = quantize_int8(torch.randn(n, k_in))
    s, bias = s.to(dtype), torch.randn(n).to(dtype)
    x, residual = (torch.randn(rows, k_in) * 3 + 1).to(dtype), torch.randn(rows, n).to(dtype)
    norm = torch.nn.LayerNorm(k_in, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k_in) + 0.5)
        norm.bias.copy_(torch.randn(k_in) / 4)
    layer_norm = (norm.weight.detach(), norm.bias.detach(), norm.eps)
    plain = linear.q8_linear(lib, x, q, s, bias)
    assert torch.equal(linear.q8_linear(lib, x, q, s, bias, residual=residual), residual + plain)
    fused = linear.q8_linear(lib, x, q, s, bias, layer_norm=layer_norm)
    apart = linear.q8_linear(lib, norm(x).detach(), q, s, bias)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, apart)
    else:
        torch.testing.assert_close(fused, apart, atol=1e-2 * apart.abs().max().item(), rtol=0)
    gelu = linear.q8_linear(lib, x, q, s, bias, gelu_tanh=True).float()
    torch.testing.assert_close(gelu, F.gelu(plain.float(), approximate="tanh"),
                               atol=1e-5 + (1e-2 if dtype == torch.bfloat16 else 0), rtol=1e-2)
    both = linear.q8_linear(lib, x, q, s, bias, gelu_tanh=True, residual=residual, layer_norm=layer_norm)
    assert torch.equal(both, residual + linear.q8_linear(lib, x, q, s, bias, gelu_tanh=True, layer_norm=layer_norm))
    with pytest.raises(ValueError, match="residual"):
        linear.q8_linear(lib, x, q, s, bias, residual=residual[:-1])
    with pytest.raises(ValueError, match="layer norm"):
        linear.q8_linear(lib, x, q, s, bias, layer_norm=(norm.weight.detach()[:64], None, 1e-6))


@pytest.mark.slow  # compiles and runs a C program per tier
def test_check_program_on_every_tier(tier_lib, tmp_path):
    """tests/native_check.c (a float32 decode step through two int8 layers, the GEMVs, decode
    attention) built with the tier's own flags: what the aarch64 run checks, on x86."""
    tier, lib = tier_lib
    check, exe = Path(__file__).with_name("native_check.c"), tmp_path / "check"
    cmd = [build.compiler(), "-O2", *tier.flags, "-fopenmp", "-I", str(build.SOURCE_DIR), str(check),
           *map(str, sorted(build.SOURCE_DIR.glob("*.c"))), "-o", str(exe), "-lm"]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and f"features {lib.features}" in ran.stdout, ran.stdout


def test_integer_vision_attention(tier_lib):
    """qvl_attention_i16 built with each tier's flags: as float SDPA on x86 (AVX2 and AVX-512
    builds, whose vision tower runs int8 x int8 in float32 there), declined elsewhere."""
    tier, lib = tier_lib
    q, k, v = (torch.randn(150, 3, 2, 72) * 2).unbind(1)
    out = attention.attention_i16(lib, q, k, v)
    if not tier.name.startswith(("avx512", "avx2")):
        assert out is None
        return
    ref = F.scaled_dot_product_attention(*(t.double().transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=0)


@pytest.mark.slow  # builds every tier's library
def test_integer_vision_attention_same_bits_on_every_x86_build():
    """The AVX-512 builds (zmm, vpdpwssd with VNNI; vpmaddwd + vpaddd in C without, as on
    Skylake-X) and the AVX2 ones (ymm, vpmaddwd in assembly) sum the same integer codes exactly
    and weigh them in the same float operations: the same bits, for each head size, with the
    RoPE applied as the codes are made, and with a last key block of padding."""
    x86 = [t for t in TIERS if t.name.startswith(("avx512", "avx2"))]
    x86 += [dataclasses.replace(t, name=t.name + "-novnni", flags=t.flags + ("-mno-avx512vnni",))
            for t in x86 if t.name == "avx512-nobf16"]
    if len(x86) < 2:
        pytest.skip("one x86 build here")
    libs = [(t.name, built(t)) for t in x86]
    torch.manual_seed(5)
    for d in (64, 72, 80):
        q, k, v = (torch.randn(150, 3, 2, d) * 2).unbind(1)
        cos, sin = torch.randn(150, d), torch.randn(150, d)
        first = None
        for name, lib in libs:
            out = (attention.attention_i16(lib, q, k, v), attention.attention_i16(lib, q, k, v, cos, sin))
            if first is None:
                first = out
                continue
            assert torch.equal(out[0], first[0]) and torch.equal(out[1], first[1]), (name, d)


def _codes(entries: dict) -> dict[str, tuple[str, int]]:
    return {kind: (k.name, k.code_bits) for kind, k in entries.items()}


_DELTA_RULE = {"delta rule, prefill": ("qvl_gated_delta_rule", 0),
               "delta rule, decode": ("qvl_gated_delta_step", 0), "short conv, prefill": ("qvl_causal_conv", 0),
               "short conv, decode": ("qvl_causal_conv_step", 0)}  # every build
_ELEMENTWISE_BF16 = {"rms_norm": ("qvl_rmsnorm", 0), "rope, text prefill": ("qvl_text_rope", 0),
                     "rope, vision": ("qvl_vision_rope", 0), "silu_mul": ("qvl_silu_mul", 0),
                     "text attention, prefill": ("qvl_attention", 0),
                     "text attention, decode": ("qvl_decode_attention", 0), "decode step": ("qvl_decode_layers", 0),
                     **_DELTA_RULE}
_ELEMENTWISE_FP32 = {"rms_norm": ("torch", 0), "rope, text prefill": ("torch", 0), "rope, vision": ("torch", 0),
                     "silu_mul": ("torch", 0), "text attention, prefill": ("sdpa", 0),
                     "text attention, decode": ("qvl_decode_attention", 0), "decode step": ("qvl_decode_layers", 0),
                     **_DELTA_RULE}
_BYTE_CODES_FP32 = {  # float32 compute with VNNI or AVX-VNNI: the byte kernel in 8-bit codes for vision and prefill
    "text linears, decode": ("gemv", 16), "text linears, prefill": ("q8_linear", 8), "lm_head": ("gemv", 16),
    "vision linears": ("q8_linear", 8), "vision attention": ("qvl_attention_i16", 16), **_ELEMENTWISE_FP32}
_BYTE_CODES_BF16 = {  # AVX-512 with VNNI and BF16, no AMX tiles
    "text linears, decode": ("gemv", 16), "text linears, prefill": ("q8_linear", 8), "lm_head": ("gemv", 16),
    "vision linears": ("q8_linear", 8), "vision attention": ("qvl_attention_q8", 8), **_ELEMENTWISE_BF16}
DEFAULT_PLANS = {  # tier -> (compute dtype, kind of layer -> (kernel, activation code bits))
    "avx512": (torch.bfloat16, _BYTE_CODES_BF16),
    "avx512-noamx": (torch.bfloat16, _BYTE_CODES_BF16),
    "avx512-nobf16": (torch.float32, _BYTE_CODES_FP32),
    "avx2-vnni": (torch.float32, _BYTE_CODES_FP32),
    "avx2": (torch.float32, {  # the byte kernel in 7-bit codes (vpmaddubsw) for the tower; prefill in 16-bit pairs
        **_BYTE_CODES_FP32, "text linears, prefill": ("i16_linear", 16), "vision linears": ("q8_linear", 7)}),
    "portable": (torch.float32, {  # int8 vision weights (memory), float products
        **_BYTE_CODES_FP32, "text linears, prefill": ("dequantize", 0), "vision linears": ("dequantize", 0),
        "vision attention": ("sdpa", 0)}),
}
AMX_PLAN = (torch.bfloat16, {  # AMX tiles: prefill's int8 products on int8 tiles, the tower int8 x int8 on them
    **_BYTE_CODES_BF16, "text linears, prefill": ("amx_i16_linear", 16), "vision linears": ("amx_int8", 8),
    "vision attention": ("qvl_attention", 0)})


@pytest.mark.parametrize("name", list(DEFAULT_PLANS))
def test_default_plan_per_tier(name):
    """The default options (int8 weights, --int8-activations auto, the tier's compute dtype) on
    each tier: the kernel and activation codes of every kind of layer, all in that dtype."""
    tier = next((t for t in TIERS if t.name == name), None)
    if tier is None:
        pytest.skip(f"this CPU cannot run the {name} tier")
    lib = Library(tier, built(tier))
    dtype, want = AMX_PLAN if lib.has(build.AMX_INT8) else DEFAULT_PLANS[name]
    plan = Plan.choose(lib, torch.bfloat16 if tier.bf16 else torch.float32, "int8")
    assert plan.dtype == dtype and plan.vision_int8
    assert _codes(plan.entries()) == want
    assert all(k.dtype == dtype for k in plan.entries().values())


def test_plan_follows_the_options(tier_lib):
    """Other options on each tier: int4 weights, bf16 weights, --int8-activations off (prefill
    and the tower in 16-bit pairs on x86, else dequantise + GEMM), bf16 on a float32 tier."""
    tier, lib = tier_lib
    k = Library(tier, lib)
    x86, amx = tier.name.startswith(("avx512", "avx2")), k.has(build.AMX_INT8)
    dtype = torch.bfloat16 if tier.bf16 else torch.float32
    int4 = _codes(Plan.choose(k, dtype, "int4").entries())
    assert int4["text linears, decode"] == ("gemv", 8) and int4["lm_head"] == ("gemv", 8)
    byte_kernel = bool(lib.q8_levels)  # int4 takes it in 8-bit codes, plain AVX2 too
    assert int4["text linears, prefill"] == (("amx_bf16_linear", 0) if amx else ("q4_linear", 8) if byte_kernel
                                             else ("dequantize", 0))
    for acts in ("vision", "off"):  # asked for: prefill's products in float
        assert _codes(Plan.choose(k, dtype, "int4", acts).entries())["text linears, prefill"] == (
            ("amx_bf16_linear", 0) if amx else ("dequantize", 0))
    off = _codes(Plan.choose(k, dtype, "int8", "off").entries())
    many = ("amx_i16_linear", 16) if amx else ("i16_linear", 16) if x86 else ("dequantize", 0)
    assert off["text linears, prefill"] == many and off["vision attention"][0] in ("qvl_attention", "sdpa")
    assert off["vision linears"] == (("torch", 0) if tier.bf16 else many)  # float32: the tower's weights int8
    bf16 = Plan.choose(k, torch.bfloat16, "bf16")
    assert not bf16.vision_int8 and bf16.activations == "off"
    assert _codes(bf16.entries())["text linears, decode"] == ("gemv", 0)
    assert _codes(bf16.entries())["text linears, prefill"] == ("torch", 0)
    assert _codes(Plan.choose(k, torch.float32, "fp32").entries())["text linears, decode"] == ("torch", 0)
    on_float32 = _codes(Plan.choose(k, torch.float32, "int8").entries())
    assert on_float32["text attention, prefill"] == ("sdpa", 0) and on_float32["rms_norm"] == ("torch", 0)
    default = Plan.choose(k, dtype, "int8")
    narrow = default.linear("text", "int8", 16, 2048)  # Gated DeltaNet's in_proj_b: a column per value head
    assert narrow.prefill.name == "dequantize" and narrow.decode == default.linear("text", "int8", 2048, 2048).decode
    assert default.linear("text", "int8", 64, 64).prefill == default.linear("text", "int8", 2048, 2048).prefill
    for plan in (Plan(k, torch.bfloat16), Plan(k, torch.float32)):  # every build decodes natively
        assert plan.decode_step == "qvl_decode_layers" and plan.decode_attention == "qvl_decode_attention"
    off_lib = Plan.choose(Library(tier, None, "QVL_NATIVE=0"), torch.float32, "int8")
    assert _codes(off_lib.entries()) == {
        "text linears, decode": ("torch_int8", 0), "text linears, prefill": ("dequantize", 0),
        "lm_head": ("torch_int8", 0), "vision linears": ("dequantize", 0), "vision attention": ("sdpa", 0),
        **_ELEMENTWISE_FP32, "text attention, decode": ("sdpa", 0), "decode step": ("per-layer", 0),
        **{kind: ("torch", 0) for kind in _DELTA_RULE}}


def test_library_features_per_tier(tier_lib):
    """What each tier's build reports: its instruction families, the byte kernel's codes (8-bit
    with VNNI, 7-bit on plain AVX2, none elsewhere) and, from this process's oneDNN, the
    activation codes its int8 GEMM sums exactly (8-bit with VNNI or AMX, 7-bit with vpmaddubsw)."""
    tier, lib = tier_lib
    k = Library(tier, lib)
    family = {"avx512": build.AVX512, "avx2": build.AVX2}.get(tier.name.split("-")[0], 0)
    assert k.has(build.AVX512) == (family == build.AVX512)
    assert k.has(build.AVX2) == (family in (build.AVX512, build.AVX2))
    assert k.has(build.AVX_VNNI) == (tier.name == "avx2-vnni")
    vnni = k.has(build.VNNI) or k.has(build.AVX_VNNI)
    assert k.q8_levels == (127 if vnni else 63 if tier.name == "avx2" else 0)
    host = library()
    assert k.int8_levels == (255 if host.has(build.VNNI) or host.has(build.AVX_VNNI) or host.has(build.AMX_INT8)
                             else 127)
    assert k.describe().startswith(tier.name) and "off" in Library(tier, None, "QVL_NATIVE=0").describe()


def test_tier_override_is_checked(monkeypatch):
    monkeypatch.setenv("QVL_ISA", "portable")
    assert build.select_tier().name == "portable"
    monkeypatch.setenv("QVL_ISA", "sse9")
    with pytest.raises(ValueError, match="QVL_ISA=sse9"):
        build.select_tier()


def test_tier_lists_per_cpu():
    zen3 = frozenset({"avx2", "fma"})
    assert [t.name for t in build.tiers(zen3, "x86_64")] == ["avx2", "portable"]
    alder = zen3 | {"avx_vnni"}
    assert [t.name for t in build.tiers(alder, "x86_64")] == ["avx2-vnni", "avx2", "portable"]
    icelake = alder - {"avx_vnni"} | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    names = [t.name for t in build.tiers(icelake, "x86_64")]
    assert names[0] == "avx512-nobf16" and "avx512" not in names and not build.tiers(icelake, "x86_64")[0].bf16
    sapphire = icelake | {"avx512_bf16", "avx_vnni", "amx_bf16"}
    best = build.tiers(sapphire, "x86_64")[0]
    assert best.name == "avx512" and best.bf16 and best.amx
    zen4 = sapphire - {"amx_bf16"}
    assert not build.tiers(zen4, "x86_64")[0].amx and build.tiers(zen4, "x86_64")[0].bf16
    graviton = frozenset({"asimd", "asimddp", "i8mm"})
    assert [t.name for t in build.tiers(graviton, "aarch64")] == ["neon", "neon-nodotprod", "portable"]
    assert [t.name for t in build.tiers(frozenset({"asimd"}), "aarch64")] == ["neon-nodotprod", "portable"]


@pytest.mark.slow  # three library builds
def test_build_cache_key_covers_tier_and_cpu(monkeypatch, tmp_path):
    avx2, portable = (next(t for t in TIERS if t.name == n) for n in ("avx2", "portable"))
    a, b = build.build(tmp_path, avx2), build.build(tmp_path, portable)
    assert a != b and a.name.startswith("qvl_kernels-avx2-")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"asimd", "asimddp"}))  # another CPU, same home
    assert build.build(tmp_path, avx2) != a


def test_unwritable_cache_folder_falls_back_with_one_warning(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QVL_CACHE_DIR", str(blocker / "qvl"))  # cannot be created, even by root
    paths.cache_root.cache_clear()
    try:
        root = paths.cache_root()
        assert root != blocker / "qvl" and root.is_dir()
        assert paths.cache_root() == root  # chosen once
        assert capsys.readouterr().err.count("cannot write the cache folder") == 1
        monkeypatch.delenv("QVL_CACHE_DIR")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        paths.cache_root.cache_clear()
        assert paths.cache_root() == tmp_path / "xdg" / "qvl"
    finally:
        monkeypatch.undo()
        paths.cache_root.cache_clear()


def test_file_lock_serialises(tmp_path):
    with paths.locked(tmp_path / "x.lock"):
        assert (tmp_path / "x.lock").exists()
    with paths.locked(tmp_path / "x.lock"):  # released: taken again
        pass


def test_imports_without_fcntl():
    """Windows has no fcntl (nor resource): every module a user can start must import without
    them, and the peak-memory figure comes from psutil there."""
    code = ("import sys; sys.modules['fcntl'] = None\n"
            "import qvl.cli, qvl.engine, qvl.server.app, qvl.batch.runner, qvl.batch.output, qvl.kernels.plan, qvl.bench\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_peak_memory_without_the_resource_module(monkeypatch):
    import psutil  # noqa: F401  (imported before resource disappears, as on Windows it needs none)

    from qvl.bench import peak_rss_mb

    with_resource = peak_rss_mb()
    monkeypatch.setitem(sys.modules, "resource", None)
    assert 10 < peak_rss_mb() and 10 < with_resource


@pytest.mark.slow  # cross-compiles and runs four builds under qemu
def test_aarch64_kernels_under_qemu(tmp_path):
    """The NEON kernels (with and without dot products; with them the byte-product kernel too, on
    sdot or with i8mm on smmla, for int8 and int4 weights) and the portable C, cross-compiled for
    aarch64 and run under qemu-user (emulating every feature: -cpu max) by tests/native_check.c."""
    cc, qemu = "aarch64-linux-gnu-gcc", "qemu-aarch64"
    if subprocess.run(["which", cc, qemu], capture_output=True).returncode != 0:
        pytest.skip("no aarch64 cross compiler / qemu-user (test.sh installs them as root)")
    check = Path(__file__).with_name("native_check.c")
    for name, flags in (("neon-i8mm", ["-march=armv8.2-a+dotprod+i8mm"]), ("neon-dotprod", ["-march=armv8.2-a+dotprod"]),
                        ("neon", ["-march=armv8-a"]), ("portable", ["-march=armv8-a", "-DQVL_PORTABLE"])):
        exe = tmp_path / f"check-{name}"
        cmd = [cc, "-O2", *flags, "-fopenmp", "-I", str(build.SOURCE_DIR), str(check),
               *map(str, sorted(build.SOURCE_DIR.glob("*.c"))), "-o", str(exe), "-lm", "-static"]
        built = subprocess.run(cmd, capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
        ran = subprocess.run([qemu, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, f"{name}:\n{ran.stdout}\n{ran.stderr}"
        features = int(ran.stdout.split("features ")[1].split()[0])
        assert bool(features & build.NEON) == (name != "portable")
        assert bool(features & build.DOTPROD) == name.startswith("neon-")
        assert bool(features & build.I8MM) == (name == "neon-i8mm")
        assert ("byte kernel checked" in ran.stdout) == name.startswith("neon-")
        assert ("int4 byte kernel checked" in ran.stdout) == name.startswith("neon-")


@pytest.mark.parametrize("kind", ["i8mm", "dotprod", "neither"])
def test_arm_with_dot_products_runs_vision_and_prefill_in_byte_codes(kind):
    """On ARM the tier's build reports its features (tests/native_check.c runs the kernels themselves
    under qemu): with dot products the vision tower's and prefill's int8 products take the byte
    kernel (8-bit codes per 64 columns; smmla with i8mm, else sdot) by default, as on x86 with
    VNNI; without them they stay in float32 (dequantise + GEMM)."""
    from types import SimpleNamespace

    dot = kind != "neither"
    flags = frozenset({"asimddp", "i8mm"} if kind == "i8mm" else {"asimddp"} if dot else set())
    tier = build.tiers(flags, "aarch64")[0]
    features = build.NEON | build.OPENMP | (build.DOTPROD if dot else 0) | (build.I8MM if kind == "i8mm" else 0)
    assert tier.name == ("neon" if dot else "neon-nodotprod")
    plan = Plan.choose(Library(tier, SimpleNamespace(features=features, q8_levels=127 if dot else 0)), torch.float32,
                       "int8")
    assert plan.vision_int8 and plan.activations == ("all" if dot else "off")
    entries = _codes(plan.entries())
    assert entries["text linears, prefill"] == entries["vision linears"] == (("q8_linear", 8) if dot else
                                                                             ("dequantize", 0))
    int4 = Plan.choose(plan.library, torch.float32, "int4").entries()["text linears, prefill"]
    assert (int4.name, int4.code_bits) == (("q4_linear", 8) if dot else ("dequantize", 0))
    assert entries["vision attention"] == ("sdpa", 0)  # the integer attention kernels are x86's

