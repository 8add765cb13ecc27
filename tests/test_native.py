"""The native kernels that are not weight-format specific: vision attention and the
int8 x int8 GEMM around oneDNN's int8 GEMM."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qvl.kernels import attention, build, elementwise, linear
from qvl.kernels import decode_step as decode_kernel
from qvl.kernels import library as library_module
from qvl.kernels.library import Library, library
from qvl.kernels.ops import byte_image_attention, image_attention, integer_image_attention
from qvl.kernels.plan import GEMV_MAX_ROWS, PACKED, Plan, default_plan
from qvl.kv_cache import BLOCK
from qvl.model.gated_deltanet import GatedRMSNorm
from qvl.model.rope import apply_rotary, inverse_frequencies, vision_cos_sin

lib = library().lib
needs_native = pytest.mark.skipif(lib is None, reason="native kernels not built (no C compiler)")
needs_attention = pytest.mark.skipif(lib is None or not lib.features & build.BF16, reason="no AVX512-BF16 kernels")


def _reference_attention(q, k, v):
    return F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)


needs_amx = pytest.mark.skipif(lib is None or not lib.features & build.AMX_INT8, reason="no AMX tiles")
AMX = lib is not None and bool(lib.features & build.AMX_INT8)


def _vision_covers(d: int) -> bool:
    """The head sizes the vision kernel takes: AMX tiles any even size up to 128 (2B's 64, the
    1152-wide towers' 72), AVX512-BF16 dot products 32, 64, 72, 80 and 128."""
    return d <= 128 and d % 2 == 0 if AMX else d in (32, 64, 72, 80, 128)


@needs_attention
@settings(max_examples=25, deadline=None)
@given(s=st.integers(1, 200), h=st.integers(1, 4), d=st.sampled_from([64, 72, 80, 96, 128]), scale=st.floats(0.1, 4.0))
def test_attention_matches_float_reference(s, h, d, scale):
    qkv = (torch.randn(s, 3, h, d) * scale).bfloat16()
    q, k, v = qkv.unbind(1)  # strided rows, as the vision tower's fused qkv gives them
    out = attention.attention(lib, q, k, v)
    if not _vision_covers(d):
        assert out is None  # the caller takes SDPA
        return
    ref = _reference_attention(q, k, v)
    assert out.shape == (s, h, d) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * max(1.0, ref.abs().max().item()), rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("d", [64, 72, 80, 40, 128])
def test_amx_vision_attention_over_a_whole_image(d):
    """A full-budget-like image (1000 patches: many 16-row query blocks, 32-key blocks and a
    padded last one) with a few very large keys late in the sequence, so each row's running
    max moves after its output has accumulated (the rescaled path): as SDPA in float32, to
    bf16's precision, and grouped heads read their shared keys."""
    n, h = 1000, 4
    qkv = torch.randn(n, 3, h, d)
    qkv[900:905, 1] *= 6  # late keys that dominate: the running max moves
    q, k, v = qkv.bfloat16().unbind(1)
    out = attention.attention(lib, q, k, v)
    ref = _reference_attention(q, k, v)
    assert out is not None and out.shape == (n, h, d)
    torch.testing.assert_close(out.float(), ref, atol=6e-3, rtol=2e-2)
    grouped = attention.attention(lib, q, k[:, :2], v[:, :2])  # 4 query heads over 2 key/value heads
    ref = _reference_attention(q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1))
    torch.testing.assert_close(grouped.float(), ref, atol=6e-3, rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("t, s, h, hkv, d", [(5, 5, 1, 1, 2), (20, 20, 3, 1, 34), (33, 17, 4, 2, 40), (7, 31, 2, 2, 80),
                                             (16, 1, 2, 1, 72), (40, 65, 4, 4, 16)])
def test_amx_vision_attention_edge_shapes(t, s, h, hkv, d):
    """Short images (fewer keys than one 16- or 32-key block, a padded last block), queries
    other than keys, grouped heads and head sizes that are not multiples of 16: as SDPA."""
    q = (torch.randn(t, h, d) * 2).bfloat16()
    k, v = (torch.randn(s, hkv, d) * 2).bfloat16(), torch.randn(s, hkv, d).bfloat16()
    out = attention.attention(lib, q, k, v)
    g = h // hkv
    ref = _reference_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    assert out is not None and out.shape == (t, h, d)
    torch.testing.assert_close(out.float(), ref, atol=6e-3, rtol=2e-2)


@needs_attention
def test_attention_declines_what_it_does_not_cover():
    q = torch.randn(10, 2, 136).bfloat16()
    assert attention.attention(lib, q, q, q) is None  # head_dim 136: neither kernel
    assert attention.attention(lib, q[..., :64].float(), q[..., :64].float(), q[..., :64].float()) is None  # fp32
    x = torch.randn(10, 2, 64)
    torch.testing.assert_close(image_attention(x, x, x), _reference_attention(x, x, x))  # SDPA takes over


needs_byte_scores = pytest.mark.skipif(lib is None or not lib.features & build.BF16 or not lib.features & build.VNNI,
                                       reason="no AVX-512 kernels with VNNI and BF16")


def _round_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)  # the kernels' rounding (halves away from zero)


def _block_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, ...] in blocks of 64 along dim 0 (zeros past n) -> codes [n64, ...] and steps (max |x|
    over the block per remaining index / levels, 1 where 0) broadcast to them."""
    n = x.shape[0]
    blocks = F.pad(x, (0, 0) * (x.dim() - 1) + (0, (-n) % 64)).view(-1, 64, *x.shape[1:])
    step = blocks.abs().amax(1, keepdim=True) / levels
    step = torch.where(step > 0, step, torch.ones_like(step)).expand_as(blocks)
    return _round_away(blocks / step).flatten(0, 1), step.flatten(0, 1)


def _byte_score_scheme(q, k, v):
    """qvl_attention_q8's scheme in float64: keys minus their mean over the image, int8 codes with
    one step per 64 keys and head; queries one step per row and head; exact integer scores; per
    row and block of 64 keys, P in codes round(255 x 2^(score - the block's top)) (scores in log2
    units); values in int8 codes with a step per channel and block of 64 keys."""
    q, k, v = q.double(), k.double(), v.double()
    s, h, d = k.shape
    blocks = F.pad(k - k.mean(0, keepdim=True), (0, 0, 0, 0, 0, (-s) % 64)).view(-1, 64, h, d)
    k_step = blocks.abs().amax(dim=(1, 3), keepdim=True) / 127  # one step per block and head
    k_step = torch.where(k_step > 0, k_step, torch.ones_like(k_step))
    k_codes = _round_away(blocks / k_step).flatten(0, 1)  # [S64, h, d]
    k_step = k_step.expand(-1, 64, -1, -1).flatten(0, 1)  # [S64, h, 1]
    q_step = q.abs().amax(-1, keepdim=True) / 127
    q_step = torch.where(q_step > 0, q_step, torch.ones_like(q_step))
    q_codes = _round_away(q / q_step)
    scores = torch.einsum("thd,shd->hts", q_codes, k_codes) * q_step.permute(1, 0, 2) * k_step.permute(1, 2, 0)
    scores = scores * torch.log2(torch.tensor(torch.e, dtype=torch.float64)) / d ** 0.5
    scores[..., s:] = -torch.inf  # keys past S
    blocks = scores.view(*scores.shape[:2], -1, 64)
    top = blocks.amax(-1, keepdim=True)
    p = torch.round(255 * torch.exp2(blocks - top)) * torch.exp2(top - top.amax(2, keepdim=True))
    v_codes, v_step = _block_codes(v, 127)
    p = p.flatten(2)
    return torch.einsum("hts,shd->thd", p, v_codes * v_step) / p.sum(-1).transpose(0, 1)[..., None]


def _assert_follows_scheme(out, q, k, v):
    """Within bf16's rounding of P, V and the output of the scheme in float64 (as close as the
    bf16 kernel is to exact attention: 0.15% of the norm), codes flipped at a rounding boundary
    aside (the kernel centres the keys in float32 and takes P's exp2 from a polynomial): one P
    code per row rounded the other way moves that row by at most 2 max|v| / 255, since the row's
    top key has the code 255 (a 3-key image with large scores showed one such flip, 0.57% of the
    norm)."""
    scheme = _byte_score_scheme(q, k, v)
    out = out.double()
    flips = 2 / 255 * v.double().norm(dim=-1).max() * (out.shape[0] * out.shape[1]) ** 0.5
    assert (out - scheme).norm() <= 5e-3 * scheme.norm() + flips + 1e-4
    assert (out - scheme).abs().max() <= 5e-2 * max(1.0, scheme.abs().max().item())


@needs_byte_scores
@settings(max_examples=25, deadline=None)
@given(s=st.integers(1, 300), h=st.integers(1, 3), d=st.sampled_from([64, 72, 80]),
       scale=st.floats(0.1, 4.0), offset=st.floats(0.0, 8.0))
@example(s=3, h=3, d=64, scale=2.8125, offset=0.0)  # one P code rounded the other way (see _assert_follows_scheme)
def test_byte_score_vision_attention_computes_its_scheme(s, h, d, scale, offset):
    """qvl_attention_q8 (the vision tower's attention in 8-bit codes where its linears run int8 x
    int8 in bf16): any number of patches (one key, a padded last 64-key block, several query
    blocks), the head sizes it takes, strided rows as the fused qkv gives them, keys sharing a large offset (the
    centring keeps their codes fine): as its scheme, and within 10% of exact attention's norm."""
    torch.manual_seed(s * 7 + d)
    qkv = torch.randn(s, 3, h, d) * torch.tensor([scale, scale, 1.0])[:, None, None]
    qkv[:, 1] += offset * torch.randn(1, h, d)
    q, k, v = qkv.bfloat16().unbind(1)
    out = attention.attention_q8(lib, q, k, v)
    assert out is not None and out.shape == (s, h, d) and out.dtype == torch.bfloat16
    _assert_follows_scheme(out, q, k, v)
    exact = _reference_attention(q.double(), k.double(), v.double())
    assert (out.double() - exact).norm() <= 0.1 * exact.norm() + 1e-3


@needs_byte_scores
def test_byte_score_vision_attention_follows_a_moving_maximum():
    """Keys late in the image that dominate (each row's running max moves after its sums have
    accumulated), a query row of zeros (uniform attention): as its scheme."""
    torch.manual_seed(0)
    n, h, d = 700, 2, 64
    q, k, v = torch.randn(n, 3, h, d).unbind(1)
    k[600:603] *= 8
    q[7] = 0
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = attention.attention_q8(lib, q, k, v)
    _assert_follows_scheme(out, q, k, v)
    torch.testing.assert_close(out[7].double(), v.double().mean(0), atol=1e-2, rtol=0)


@needs_byte_scores
def test_byte_score_vision_attention_leaves_nan_and_other_heads_to_the_bf16_kernel():
    x = torch.randn(10, 2, 96).bfloat16()
    assert attention.attention_q8(lib, x, x, x) is None  # head size 96
    assert attention.attention_q8(lib, *(x[..., :64].float(),) * 3) is None  # float32
    qkv = list(torch.randn(3, 50, 2, 64).bfloat16().unbind(0))
    for which in range(3):
        for value in (float("nan"), float("inf"), -float("inf")):
            args = list(qkv)
            args[which] = args[which].clone()
            args[which][17, 1, 3] = value
            assert attention.attention_q8(lib, *args) is None  # no codes for it
            if value != value:  # NaN: the bf16 kernel carries it in its head as the reference does
                out = byte_image_attention(*args)
                assert out[:, 1].isnan().any() and not out[:, 0].isnan().any()
    q, k, v = torch.randn(3, 3, 2, 64).bfloat16().unbind(0)
    k[:, 1, 3] = torch.tensor([3e38, -3e38, -3e38])  # finite keys whose distance to their mean overflows
    assert attention.attention_q8(lib, q, k, v) is None


needs_integer_attention = pytest.mark.skipif(lib is None or not lib.features & build.AVX2, reason="no AVX2 kernels")


def _assert_close_to_float64(out, q, k, v):
    """The integer kernel's error bound: its codes (13 bits for q, k and v, P in steps of 2^-13
    of each block's largest probability) keep every output within 1% of the largest and the
    rows at cosine 0.9999 of float64 SDPA."""
    ref = _reference_attention(q.double(), k.double(), v.double()).double()
    assert out is not None and out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-2 * max(1.0, ref.abs().max().item()), rtol=0)
    assert F.cosine_similarity(out.double().flatten(1), ref.flatten(1), dim=1).min() > 0.9999


@needs_integer_attention
@settings(max_examples=25, deadline=None)
@given(s=st.integers(1, 300), h=st.integers(1, 3), d=st.sampled_from([64, 72, 80]), scale=st.floats(0.1, 4.0))
def test_integer_vision_attention_matches_float_reference(s, h, d, scale):
    """qvl_attention_i16 (the vision tower's attention where its linears run int8 x int8 in
    float32): any number of patches (one key, a padded last 64-key block, several query
    blocks), the head sizes of the family's towers, strided rows as the fused qkv gives them."""
    q, k, v = (torch.randn(s, 3, h, d) * torch.tensor([scale, scale, 1.0])[:, None, None]).unbind(1)
    _assert_close_to_float64(attention.attention_i16(lib, q, k, v), q, k, v)


@needs_integer_attention
def test_integer_vision_attention_follows_a_moving_maximum_and_outlier_channels():
    """Keys late in the image that dominate (each row's running top moves after its sums have
    accumulated: the rescaled path), a value channel 100x the others (the per-channel steps)
    and a query row of zeros (uniform attention)."""
    n, h, d = 700, 2, 64
    q, k, v = torch.randn(n, 3, h, d).unbind(1)
    k[600:603] *= 8
    v[:, :, 5] *= 100
    q[7] = 0
    _assert_close_to_float64(attention.attention_i16(lib, q, k, v), q, k, v)


@needs_integer_attention
def test_integer_vision_attention_leaves_what_it_does_not_cover_to_sdpa():
    x = torch.randn(10, 2, 96)
    assert attention.attention_i16(lib, x, x, x) is None  # head size 96
    assert attention.attention_i16(lib, x[..., :64].bfloat16(), x[..., :64].bfloat16(), x[..., :64].bfloat16()) is None
    q, k, v = torch.randn(3, 50, 2, 64).unbind(0)
    k[17, 1, 3] = float("nan")
    assert attention.attention_i16(lib, q, k, v) is None  # NaN: no codes for it
    cos, sin = _rope_tables(50, 64)
    out = integer_image_attention(q, k, v, cos, sin)  # SDPA takes over and carries the NaN as the reference does
    assert out[:, 1].isnan().all() and not out[:, 0].isnan().any()


def _rope_tables(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's RoPE tables for n patches in rows of 16: cos, sin [n, 1, d]."""
    rows = torch.stack([torch.arange(n) // 16, torch.arange(n) % 16], -1)
    return vision_cos_sin(rows, inverse_frequencies(d // 2, 10000.0))


@needs_integer_attention
@pytest.mark.parametrize("n, d", [(1, 64), (130, 72), (300, 80)])
def test_integer_vision_attention_rotates_q_and_k_as_it_codes_them(n, d):
    """Given the tower's RoPE tables, the kernel rotates the unrotated q and k itself (the tower's
    separate rotation passes skipped): as float64 SDPA over the reference's rotation."""
    q, k, v = (torch.randn(n, 3, 2, d) * torch.tensor([2.0, 2.0, 1.0])[:, None, None]).unbind(1)
    cos, sin = _rope_tables(n, d)
    q_rot, k_rot = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    _assert_close_to_float64(attention.attention_i16(lib, q, k, v, cos, sin), q_rot, k_rot, v)
    assert attention.attention_i16(lib, q[:-1], k, v, cos, sin) is None if n > 1 else True  # tables need T == S


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("levels", [255, 127])
def test_int8_activation_matmul_close_to_float(dtype, levels):
    """Activations per row in 8-bit codes (VNNI, AMX) or 7-bit ones (vpmaddubsw), shifted
    inputs (one-sided rows, as after a GELU) as close as centred ones."""
    if levels > library().int8_levels:
        pytest.skip("this CPU's oneDNN multiplies bytes with vpmaddubsw, which saturates on 8-bit codes")
    x = torch.randn(40, 256).to(dtype)
    x[20:] = x[20:].abs() + 3
    w = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    scale, bias = (torch.rand(96) / 50).to(dtype), torch.randn(96).to(dtype)
    ref = F.linear(x.float(), w.float() * scale.float()[:, None], bias.float())
    out = linear.int8_matmul(lib, x, linear.pack_int8(w), colsums(w), scale, bias, levels)
    assert out.dtype == dtype and out.shape == (40, 96)
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), 0) > (0.999 if levels == 255 else 0.997)
    torch.testing.assert_close(out.float(), ref, atol=(3e-2 if levels == 255 else 6e-2) * ref.abs().max().item(),
                               rtol=0)


@needs_native
def test_int8_matmul_in_row_blocks_equals_one_call(monkeypatch):
    """Large products run oneDNN's GEMM per block of rows (the float32 product stays in cache):
    every row comes out bit-identical to the single call."""
    x, w = torch.randn(600, 256), torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    scale, bias = torch.rand(96) / 50, torch.randn(96)
    whole = linear.int8_matmul(lib, x, linear.pack_int8(w), colsums(w), scale, bias, 255, gelu_tanh=True)
    monkeypatch.setattr(linear, "INT8_GEMM_MIN_ROWS", 16)
    monkeypatch.setattr(linear, "INT8_GEMM_OUTPUT_FLOATS", 70 * 96)  # blocks of 70 rows, the last one short
    assert torch.equal(linear.int8_matmul(lib, x, linear.pack_int8(w), colsums(w), scale, bias, 255, gelu_tanh=True),
                       whole)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gelu", [False, True])
def test_int8_matmul_adds_the_residual_as_the_separate_add_would(dtype, gelu, monkeypatch):
    """The vision blocks' `x + proj(...)` and `x + fc2(...)` fused into the rescale pass: bit
    for bit the product rounded to the dtype and then added, across row blocks and a width
    that is not a multiple of 16 (the pass's scalar tail)."""
    x, w = torch.randn(300, 256).to(dtype), torch.randint(-127, 128, (99, 256), dtype=torch.int8)
    scale, bias, residual = (torch.rand(99) / 50).to(dtype), torch.randn(99).to(dtype), torch.randn(300, 99).to(dtype)
    bias[0] = -1e4  # a column far below zero: its GELU is ~0, not NaN (1 + 2^u overflowing)
    monkeypatch.setattr(linear, "INT8_GEMM_MIN_ROWS", 16)
    monkeypatch.setattr(linear, "INT8_GEMM_OUTPUT_FLOATS", 70 * 99)  # several row blocks
    args = (lib, x, linear.pack_int8(w), colsums(w), scale, bias, 255, gelu)
    fused = linear.int8_matmul(*args, residual=residual)
    assert torch.equal(fused, residual + linear.int8_matmul(*args))
    if gelu:
        assert linear.int8_matmul(*args)[:, 0].abs().max() < 1e-6
    for wrong in (residual[:10], residual.reshape(150, 198)):  # too few rows; the right size, wrong shape
        with pytest.raises(ValueError, match="residual"):
            linear.int8_matmul(*args, residual=wrong)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(77, 100, 48), (5, 64, 16), (300, 256, 96), (64, 200, 1040)])
def test_amx_int8_matmul_equals_the_onednn_path(dtype, m, k, n):
    """qvl's AMX int8 kernel (each 32 x 32 block of sums rescaled in cache) gives bit for bit
    what oneDNN's GEMM and the separate rescale pass give, with the norm, GELU and residual
    fused, for rows and depths that are not whole tiles (zero-padded codes), a last block of 16
    columns, one thread or two."""
    x = (torch.randn(m, k) * 2 + 0.5).to(dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, bias, residual = (torch.rand(n) / 50).to(dtype), torch.randn(n).to(dtype), torch.randn(m, n).to(dtype)
    norm = ((torch.rand(k) + 0.5).to(dtype), torch.randn(k).to(dtype), 1e-6)
    tiles = linear.amx_pack_int8(lib, w)
    assert tiles.shape == (n, -(-k // 64) * 64)
    for gelu, res, ln in [(False, None, None), (True, None, norm), (False, residual, norm), (True, residual, None)]:
        args = (scale, bias, 255, gelu, res, ln)
        want = linear.int8_matmul(lib, x, linear.pack_int8(w), colsums(w), *args)
        for threads in (1, 2):
            with torch_threads(threads):
                assert torch.equal(linear.int8_matmul(lib, x, tiles, colsums(w), *args, amx=True), want)
    with pytest.raises(ValueError, match="multiple of 16"):
        linear.amx_pack_int8(lib, w[:15])


@needs_native
def test_int8_linear_packs_amx_tiles_where_the_cpu_has_them(monkeypatch):
    """A plan of int8 x int8 products packs the layer's weight: AMX tiles for widths of a
    multiple of 16 on AMX CPUs, oneDNN's packing otherwise (a build without the byte kernel
    here); either way the product is the same."""
    from qvl.quantize import Int8Linear

    layer = Int8Linear(128, 48, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-127, 128, (48, 128), dtype=torch.int8))
        layer.scales.copy_(torch.rand(48) / 50)
        layer.bias.copy_(torch.randn(48))
    x = torch.randn(100, 128).bfloat16()
    layer.use_plan(Plan(library(), torch.bfloat16), "vision")
    before = layer(x)
    monkeypatch.setattr(Library, "q8_levels", property(lambda self: 0))  # no byte kernel: oneDNN or AMX packs
    layer.use_plan(Plan(library(), torch.bfloat16, "int8", vision_int8=True, activations="vision"), "vision")
    assert layer.plan.prefill.name == ("amx_int8" if AMX else "onednn_int8") and layer.weight is None
    torch.testing.assert_close(layer(x).float(), before.float(), atol=3e-2 * before.abs().max().item(), rtol=0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_matmul_layer_normalises_its_rows_in_the_quantise_pass(dtype):
    """The vision blocks' norm1 -> qkv and norm2 -> fc1 fused: the rows are normalised (float32
    moments, rounded to the dtype as torch's LayerNorm rounds) inside the quantise pass. In bf16
    the normalised rows match torch's to the last bit almost everywhere; the products match
    within a code's rounding; a norm of the wrong width or dtype is refused."""
    x = (torch.randn(300, 256) * 3 + 1).to(dtype)
    w = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    scale, bias = (torch.rand(96) / 50).to(dtype), torch.randn(96).to(dtype)
    norm = torch.nn.LayerNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256) + 0.5)
        norm.bias.copy_(torch.randn(256) / 4)
    args = (lib, x, linear.pack_int8(w), colsums(w), scale, bias, 255)
    fused = linear.int8_matmul(*args, layer_norm=(norm.weight.detach(), norm.bias.detach(), norm.eps)).float()
    apart = linear.int8_matmul(lib, norm(x).detach(), *args[2:]).float()
    torch.testing.assert_close(fused, apart, atol=2e-2 * apart.abs().max().item(), rtol=0)
    if dtype == torch.bfloat16:  # the same bf16 rows almost everywhere, so mostly the same outputs
        assert (fused == apart).float().mean() > 0.9
    with pytest.raises(ValueError, match="layer norm"):
        linear.int8_matmul(*args, layer_norm=(norm.weight.detach()[:128], None, 1e-6))
    with pytest.raises(ValueError, match="layer norm"):  # a short bias would be read past its end
        linear.int8_matmul(*args, layer_norm=(norm.weight.detach(), norm.bias.detach()[:128], 1e-6))


def colsums(w: torch.Tensor) -> torch.Tensor:
    return w.sum(1, dtype=torch.int32).float()


@needs_native
def test_engine_option_switches_int8_layers_to_int8_activations(tiny_checkpoint):
    from qvl.engine import Engine, EngineOptions
    from qvl.quantize import Int8Linear

    plain = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", vision_int8=True, threads=1,
                                      int8_activations="off"))
    fast = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", vision_int8=True, threads=1,
                                     int8_activations="all"))
    layers = [(n, m) for n, m in fast.model.named_modules() if isinstance(m, Int8Linear) and n != "lm_head"]
    # the vision tower's and decoder layers' products in 8-bit codes per group where the CPU has
    # VNNI (unpacked), else packed per row
    groups = fast.plan.group_codes
    assert layers and all(m.plan.prefill.name in (("q8_linear",) if groups else PACKED) for n, m in layers)
    assert all((m.packed is None) == groups for n, m in layers)
    assert fast.model.lm_head.plan.prefill.name not in ("q8_linear", *PACKED)  # prefill computes one row of logits
    assert plain.model_id != fast.model_id  # cached answers of one never serve the other
    layer, x = fast.model.visual.blocks[0].mlp.linear_fc1, torch.randn(50, 64).to(fast.model.dtype)
    assert (layer.weight is None) != groups  # one copy of the vision weights: the packed one or the plain one
    same = plain.model.visual.blocks[0].mlp.linear_fc1
    ref = F.linear(x.float(), same.dequantized().float(), same.bias.float())
    assert F.cosine_similarity(layer(x).float().flatten(), ref.flatten(), 0) > 0.999


@needs_attention
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       length=st.integers(1, 300), d=st.sampled_from([32, 64, 128]), ragged=st.booleans())
def test_decode_attention_matches_sdpa_over_cache_views(b, kv_heads, group, length, d, ragged):
    """Rows of different lengths (as continuous batching leaves them), each in blocks scattered
    over the pool through its block table, attend to their own positions only; what lies past a
    row's length and in blocks no row holds (NaN here) is never read."""
    keys, values, table = _paged_rows(b, kv_heads, length, d)
    q = (torch.randn(b, kv_heads * group, 1, d) * 2).bfloat16()
    lengths = torch.randint(1, length + 1, (b,)) if ragged else torch.full((b,), length)
    for r, n in enumerate(lengths.tolist()):  # past the row's length: NaN
        for j in range(n, table.shape[1] * BLOCK):
            keys[table[r, j // BLOCK], :, j % BLOCK] = float("nan")
            values[table[r, j // BLOCK], :, j % BLOCK] = float("nan")
    out = attention.decode_attention(lib, q, keys, values, table, lengths)
    for r, n in enumerate(lengths.tolist()):
        k, v = (_row_positions(x, table[r], n) for x in (keys, values))
        ref = F.scaled_dot_product_attention(q[r : r + 1].float(), k[None].float(), v[None].float(), enable_gqa=True)
        torch.testing.assert_close(out[r : r + 1].float(), ref, atol=2e-2, rtol=2e-2)
        alone = attention.decode_attention(lib, q[r : r + 1], keys, values, table[r : r + 1], lengths[r : r + 1])
        assert torch.equal(alone, out[r : r + 1])  # a row's result does not depend on the others


def _paged_rows(b: int, kv_heads: int, length: int, d: int):
    """A pool layer [blocks, H_kv, BLOCK, d] of random bf16 with NaN in spare blocks, and a
    table [b, ceil(length / BLOCK)] giving each row blocks in random order."""
    n = -(-length // BLOCK)
    spare = 3
    keys = torch.randn(b * n + spare, kv_heads, BLOCK, d).bfloat16()
    values = torch.randn(b * n + spare, kv_heads, BLOCK, d).bfloat16()
    order = torch.randperm(b * n + spare)
    for block in order[b * n :]:
        keys[block], values[block] = float("nan"), float("nan")
    return keys, values, order[: b * n].view(b, n).clone()


def _row_positions(pool: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """A row's first n positions of a pool layer, contiguous: [H_kv, n, d]."""
    x = pool[blocks]  # [nb, H, BLOCK, d]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :n]


@needs_attention
@settings(max_examples=20, deadline=None)
@given(start=st.integers(0, 150), t=st.integers(1, 90), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 4]), d=st.sampled_from([32, 64, 128]))
def test_prefill_attention_reads_the_paged_cache(start, t, kv_heads, group, d):
    """Causal prefill of one row over its blocks (scattered over the pool) equals SDPA over the
    same positions laid out contiguously; spare blocks (NaN) are never read."""
    keys, values, table = _paged_rows(1, kv_heads, start + t, d)
    q = torch.randn(t, kv_heads * group, d).bfloat16()
    out = attention.paged_attention(lib, q, keys, values, table[0], start)
    k, v = (_row_positions(x, table[0], start + t).transpose(0, 1) for x in (keys, values))
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=mask[None, None],
                                         enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * max(1.0, ref.abs().max().item()), rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("d, block", [(128, 16), (96, 32), (112, 48), (64, 32)])
def test_amx_prefill_attention_with_a_moving_max(d, block):
    """Causal prefill on AMX tiles over a pool of other block sizes, with head sizes whose
    output does not fit the tiles (96, 112, 128: columns past 64 summed in memory) and a few
    late keys far larger than the rest, so rows' running max moves after their output has
    accumulated: as SDPA in float32, for a whole prompt and for a slice after a prefix."""
    length, kv_heads, group = 200, 2, 2
    n = -(-length // block)
    keys, values = (torch.randn(n + 2, kv_heads, block, d).bfloat16() for _ in range(2))
    table = torch.randperm(n + 2)[:n]
    flat = keys[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)  # a copy, positions in order
    flat[:, 150:153] *= 8  # late keys that dominate
    for j in range(150, 153):
        keys[table[j // block], :, j % block] = flat[:, j]
    k, v = (x[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :length].float() for x in (keys, values))
    for start in (0, 120):
        q = (torch.randn(length - start, kv_heads * group, d) * 2).bfloat16()
        out = attention.paged_attention(lib, q, keys, values, table, start)
        mask = torch.arange(length)[None, :] <= torch.arange(start, length)[:, None]
        ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k[None], v[None],
                                             attn_mask=mask[None, None], enable_gqa=True)[0].transpose(0, 1)
        assert out is not None
        torch.testing.assert_close(out.float(), ref, atol=2e-2 * max(1.0, ref.abs().max().item()), rtol=2e-2)


@needs_attention
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_attention_gives_a_row_the_same_bits_in_any_slice(d):
    """A prompt prefilled in slices (each over the cache the earlier ones filled) leaves every
    query row the bits one call gives it (AMX tiles or AVX512-BF16 dot products): so a request's
    tokens do not depend on how the scheduler cut its prompt."""
    t, kv_heads, group = 150, 2, 2
    keys, values, table = _paged_rows(1, kv_heads, t, d)
    q = (torch.randn(t, kv_heads * group, d) * 2).bfloat16()
    q[100:103] *= 8  # rows whose scores are large: their running max moves
    whole = attention.paged_attention(lib, q, keys, values, table[0], 0)
    for cut in ((1, 17, 48, 150), (25, 50, 75, 100, 125, 150), (3, 4, 149, 150)):
        parts, start = [], 0
        for end in cut:
            parts.append(attention.paged_attention(lib, q[start:end], keys, values, table[0], start))
            start = end
        assert torch.equal(torch.cat(parts), whole), cut


@needs_attention
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_bf16_model_with_native_kernels_matches_torch_kernels(tiny_checkpoint, monkeypatch, weights):
    """Prefill, then decode steps over the cache: every kernel switched on vs all of torch's."""
    from qvl.engine import Engine, EngineOptions
    from qvl.generate import decode_step, new_cache

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights=weights, dtype="bf16", threads=1))
    model, ids = engine.model, torch.tensor([9707, 11, 1879, 0, 108386, 151644, 872, 198, 3838, 374, 13, 42])

    def run() -> torch.Tensor:
        cache = new_cache(model, 1, 32)
        positions = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = model.rope(positions)
        with torch.inference_mode():
            h = model.language_model(model.embed(ids[None]), cos, sin, cache, 0)
            logits = [model.logits(h)[:, -1]]
            for step in range(4):
                token = logits[-1].argmax(-1)
                logits.append(decode_step(model, cache, token, torch.tensor([len(ids) + step]),
                                          torch.tensor([len(ids) + step])))
        return torch.cat(logits).float()

    native_logits = run()
    torch_only = Library(build.select_tier(), None, "test")
    monkeypatch.setattr(library_module, "_chosen", [torch_only])
    for part in (model.language_model, model.lm_head):  # the decoder's layers, given the plan of torch's kernels
        Plan(torch_only, model.dtype).apply(part)
    model.language_model.step_args = None
    torch_logits = run()
    cosine = F.cosine_similarity(native_logits, torch_logits, dim=-1)
    assert cosine.min() > (0.99 if weights == "int4" else 0.999), cosine


@needs_attention
@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 150), start=st.integers(0, 150), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), d=st.sampled_from([32, 64, 128]))
def test_causal_prefill_attention_over_a_cache_matches_sdpa(t, start, kv_heads, group, d):
    """A prefill chunk of t queries at positions start..start+t over a cache holding start+t."""
    capacity, length = start + t + 5, start + t
    cache_k = torch.randn(1, kv_heads, capacity, d).bfloat16()
    cache_v = torch.randn(1, kv_heads, capacity, d).bfloat16()
    keys, values = cache_k[0, :, :length].transpose(0, 1), cache_v[0, :, :length].transpose(0, 1)  # [S, Hkv, D]
    q = (torch.randn(t, kv_heads * group, d) * 2).bfloat16()
    out = attention.attention(lib, q, keys, values, causal_from=start)
    mask = torch.arange(length)[None, :] <= torch.arange(start, start + t)[:, None]
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
                                         values.float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.float(), ref[0].transpose(0, 1), atol=2e-2, rtol=2e-2)


@needs_native
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 16, 1, 128), (1, 300, 256)])
def test_rms_norm_matches_the_reference_formula(shape):
    from qvl.model.text import RMSNorm

    norm = RMSNorm(shape[-1], 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = (torch.randn(*shape) * 5).bfloat16()
    h = x.float()
    reference = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    out = norm(x)  # the native kernel for bf16
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    differ = out != reference  # only a float32 sum in another order can move a value by one bf16 step
    assert differ.float().mean() < 1e-3
    torch.testing.assert_close(out.float(), reference.float(), atol=0, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 16, 128), (1, 300, 16, 128), (3, 48)])
def test_gated_rms_norm_matches_the_reference_module(shape, dtype):
    norm = GatedRMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x, gate = (torch.randn(*shape) * 5).to(dtype), (torch.randn(*shape) * 4).to(dtype)
    h = x.float()
    reference = (norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
                 * F.silu(gate.float())).to(dtype)
    out = norm(x, gate)  # the native kernel
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.bfloat16:  # a float32 sum in another order, or SiLU's exponential, moves a value by one step
        assert (out != reference).float().mean() < 1e-2
        torch.testing.assert_close(out.float(), reference.float(), atol=1e-5, rtol=1e-2)
    else:
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def _count_one_calls(monkeypatch) -> list[bool]:
    """Record each decode_step.decode_layers call (qvl.kernels): True when the one-call kernel ran the step, False
    when it declined (None) and the per-op path ran it."""
    calls = []
    one_call = decode_kernel.decode_layers

    def counted(*a, **k):
        out = one_call(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(decode_kernel, "decode_layers", counted)
    return calls


def _greedy_two_rows(model, steps: int):
    """Two prompts of different lengths prefilled into rows 0 and 1 of one cache, then `steps`
    greedy decode steps of both rows together: (logits [steps, 2, V], tokens [steps, 2], the
    cache, the prompt lengths)."""
    from qvl.generate import decode_step, new_cache

    ids = torch.tensor([9707, 11, 1879, 0, 108386, 151644, 872, 198, 3838, 374, 13, 42])
    text, cache = model.language_model, new_cache(model, 2, len(ids) + steps + 4)
    lengths = torch.tensor([len(ids), len(ids) - 3])  # row 1 holds a shorter prompt
    with torch.inference_mode():
        logits = []
        for r, n in enumerate(lengths.tolist()):
            cos, sin = model.rope(torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
            logits.append(model.logits(text(model.embed(ids[None, :n]), cos, sin, cache.row(r), 0))[:, -1])
        logits, all_logits, tokens = torch.cat(logits), [], []
        for step in range(steps):
            tokens.append(logits.argmax(-1))
            logits = decode_step(model, cache, tokens[-1], lengths + step, lengths + step)
            all_logits.append(logits)
    return torch.stack(all_logits), torch.stack(tokens), cache, lengths


@needs_native
@pytest.mark.parametrize("weights,dtype", [("bf16", "bf16"), ("int8", "bf16"), ("int4", "bf16"), ("int8", "fp32"),
                                           ("int4", "fp32")])
def test_one_call_decode_step_equals_the_per_op_path(tiny_checkpoint, weights, dtype, monkeypatch):
    """The whole-step kernel (every layer in one native call) against the per-layer modules
    running the same kernels: same logits and same cache, for two rows of different lengths.
    bf16: the same roundings, keys bit for bit; float32 (CPUs without BF16): RMSNorm and RoPE
    sum in another order than torch's, so within float32 rounding (and the 16-bit activation
    roundings that it can move)."""
    from qvl.engine import Engine, EngineOptions

    if dtype == "bf16" and (lib is None or not lib.features & build.BF16):
        pytest.skip("bf16 compute is the default only with AVX512-BF16")
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights=weights, dtype=dtype, threads=2))
    model, text = engine.model, engine.model.language_model
    calls = _count_one_calls(monkeypatch)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        logits, _, cache, lengths = _greedy_two_rows(model, 5)
        return logits, torch.cat([cache.pool.keys[:, cache.table[r]].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, : n + 5]
                                  for r, n in enumerate(lengths.tolist())], dim=2)

    text.step_args = None
    logits, keys = run()
    assert calls == [True] * 5  # every decode step went through the one-call kernel
    text.step_args = False  # per-op path
    ref_logits, ref_keys = run()
    assert len(calls) == 5
    if dtype == "bf16":
        torch.testing.assert_close(keys, ref_keys, atol=0, rtol=0)
        torch.testing.assert_close(logits, ref_logits, atol=1e-2, rtol=0)
    elif weights == "int8":  # a 1e-7 difference can move an activation's 16-bit rounding (1e-4 after)
        torch.testing.assert_close(keys, ref_keys, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=0)
    else:  # int4 rounds activations to 8 bits: a moved rounding shows, as between any two int4 kernels
        assert F.cosine_similarity(logits.flatten(1), ref_logits.flatten(1), dim=-1).min() > 0.99


@pytest.fixture(scope="module")
def moe128_checkpoint(tmp_path_factory):
    """tiny-moe with experts of 128: int4 groups of 128 divide them, and every expert product
    takes the integer kernels (K a multiple of 128)."""
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("moe128"), "tiny-moe", seed=4,
                            changes={"text_config": {"moe_intermediate_size": 128}})


@needs_native
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.slow  # a 128-expert checkpoint
def test_one_call_decode_step_runs_a_mixture_of_experts_as_the_per_op_path(moe128_checkpoint, weights,
                                                                             monkeypatch):
    """A mixture-of-experts model decodes in the one-call step too (router, softmax, top-k and
    the chosen experts in the kernel): the same greedy tokens and, within bf16 roundings (the
    softmax sums in another order), the same logits as the per-layer modules, for two rows of
    different lengths."""
    from qvl.engine import Engine, EngineOptions
    from qvl.quantize import Int4Experts, Int8Experts

    if lib is None or not lib.features & build.BF16:
        pytest.skip("bf16 compute is the default only with AVX512-BF16")
    engine = Engine.load(EngineOptions(model=str(moe128_checkpoint), weights=weights, threads=2))
    model, text = engine.model, engine.model.language_model
    assert type(text.layers[0].mlp.experts) is (Int8Experts if weights == "int8" else Int4Experts)
    calls = _count_one_calls(monkeypatch)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        logits, tokens, _, _ = _greedy_two_rows(model, 8)
        return logits, tokens

    text.step_args = None
    logits, tokens = run()
    assert calls == [True] * 8
    text.step_args = False  # per-op path
    ref_logits, ref_tokens = run()
    assert len(calls) == 8
    assert torch.equal(tokens, ref_tokens)
    # int4 rounds activations to 8 bits: a rounding moved by the softmax's sum order shows more
    bound = 0.9999 if weights == "int8" else 0.99
    assert F.cosine_similarity(logits.float().flatten(1), ref_logits.float().flatten(1), dim=-1).min() > bound


@needs_attention
@pytest.mark.parametrize("d", [64, 72, 128])  # 72: the 1152-wide tower of 4B and larger (16 heads)
def test_vision_rotary_native_pass_equals_the_reference(d):
    """Bit for bit, over enough values (~0.5M) that a product fused into an FMA would show."""
    from qvl.kernels.ops import vision_rotary
    from qvl.model.rope import apply_rotary, inverse_frequencies, vision_cos_sin

    n, h = 4096 // (d // 32), 4
    gen = torch.Generator().manual_seed(d)
    qkv = (torch.randn(n, 3, h, d, generator=gen) * 3).bfloat16()
    q = qkv[:, 0]  # a strided view, as the fused qkv gives it
    cos, sin = vision_cos_sin(torch.randint(0, 60, (n, 2), generator=gen), inverse_frequencies(d // 2, 10000.0))
    out = vision_rotary(q, cos, sin)
    assert out.is_contiguous() and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, apply_rotary(q.float(), cos, sin).bfloat16(), atol=0, rtol=0)
    if default_plan(torch.bfloat16).vision_rope == "qvl_vision_rope":  # and it was the native pass, not the fallback
        assert torch.equal(elementwise.vision_rope(lib, q, cos, sin), out)


def test_fused_linear_gelu_matches_linear_then_gelu():
    """The vision MLP's fc1 + tanh-GELU in one oneDNN call (bf16) against the two-step
    reference: within one bf16 rounding of the float result."""
    from torch import nn

    from qvl.kernels.ops import LINEAR_POINTWISE, linear_gelu_tanh

    if LINEAR_POINTWISE is None:
        pytest.skip("torch built without oneDNN")
    fc = nn.Linear(128, 96).bfloat16()
    x = torch.randn(50, 128).bfloat16()
    exact = F.gelu(F.linear(x.float(), fc.weight.float(), fc.bias.float()), approximate="tanh")
    out = linear_gelu_tanh(fc, x)
    assert out.dtype == torch.bfloat16 and out.shape == (50, 96)
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(linear_gelu_tanh(fc.float(), x.float()), exact, atol=1e-5, rtol=1e-5)


@needs_native
def test_int8_matmul_with_fused_gelu_matches_gelu_after():
    x = torch.randn(40, 256).bfloat16()
    w = torch.randint(-127, 128, (200, 256), dtype=torch.int8)
    scale, bias = (torch.rand(200) / 50).bfloat16(), torch.randn(200).bfloat16()
    plain = linear.int8_matmul(lib, x, linear.pack_int8(w), colsums(w), scale, bias, 255)
    fused = linear.int8_matmul(lib, x, linear.pack_int8(w), colsums(w), scale, bias, 255, gelu_tanh=True)
    torch.testing.assert_close(fused.float(), F.gelu(plain.float(), approximate="tanh"), atol=2e-2, rtol=1e-2)


@needs_attention
def test_one_call_decode_step_refuses_a_full_cache(tiny_checkpoint):
    from qvl.engine import Engine, EngineOptions
    from qvl.generate import decode_step, new_cache

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", dtype="bf16", threads=1))
    cache = new_cache(engine.model, 1, 4)
    before = cache.pool.keys.view(torch.int16).clone()  # bit patterns: an unwritten cache may hold NaNs
    end = torch.tensor([cache.capacity])  # the first position past the row's blocks
    with pytest.raises(ValueError, match="KV cache overflow"), torch.inference_mode():
        decode_step(engine.model, cache, torch.tensor([5]), end, end)
    assert torch.equal(cache.pool.keys.view(torch.int16), before)


@needs_attention
def test_one_call_decode_step_leaves_what_it_does_not_cover_to_the_layers(tiny_checkpoint, monkeypatch):
    """A one-token prefill chunk carrying DeepStack features, and more rows than the GEMV
    kernels take, run the per-layer modules."""
    from qvl.engine import Engine, EngineOptions
    from qvl.generate import decode_step, new_cache

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", dtype="bf16", threads=1))
    model, text = engine.model, engine.model.language_model
    calls = []
    one_call = decode_kernel.decode_layers
    monkeypatch.setattr(decode_kernel, "decode_layers", lambda *a, **k: calls.append(1) or one_call(*a, **k))
    d = model.cfg.text.hidden_size
    h = torch.randn(1, 1, d).bfloat16()
    cos, sin = model.rope(torch.full((3, 1, 1), 7))
    deepstack = [torch.randn(1, d).bfloat16() for _ in model.cfg.vision.deepstack_visual_indexes]
    with torch.inference_mode():
        out = text(h, cos, sin, new_cache(model, 1, 8), 0, torch.tensor([[True]]), deepstack)
        text.step_args = False
        ref = text(h, cos, sin, new_cache(model, 1, 8), 0, torch.tensor([[True]]), deepstack)
        text.step_args = None
        assert not calls
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        rows = GEMV_MAX_ROWS + 1
        cache = new_cache(model, rows, 8)
        decode_step(model, cache, torch.full((rows,), 5), torch.full((rows,), 3), torch.full((rows,), 3))
        assert not calls
        decode_step(model, new_cache(model, 2, 8), torch.full((2,), 5), torch.full((2,), 0), torch.full((2,), 0))
        assert len(calls) == 1


@pytest.mark.slow  # fresh processes
def test_the_kernel_library_name_is_the_same_in_every_process():
    """The built library is found again by the next start: its name must not depend on the
    per-process order of a set (string hashing is randomised per process), or most starts
    would compile the kernels again (seconds) and the cache would grow with each."""
    import os
    import subprocess
    import sys

    code = "from qvl.kernels import build; print(build.library_name(build.select_tier(), 'cc 1'))"
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(6)}
    assert len(names) == 1, names


def test_kernel_libraries_no_start_has_loaded_for_a_month_are_removed(tmp_path):
    """Each qvl version (and compiler, and tier) builds its own library: the one a start loads
    is marked used; others beside it unused for UNUSED_LIBRARY_DAYS go."""
    import os
    import subprocess
    import time

    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    tier = build.select_tier()
    current = tmp_path / build.library_name(tier, subprocess.run([cc, "--version"], capture_output=True,
                                                                   text=True).stdout)
    current.write_bytes(b"built")  # present: build() returns it without compiling
    month = time.time() - (build.UNUSED_LIBRARY_DAYS + 1) * 86400
    old = tmp_path / f"qvl_kernels-avx2-0123{build.LIBRARY_SUFFIX}"
    recent = tmp_path / f"qvl_kernels-avx2-4567{build.LIBRARY_SUFFIX}"
    for path in (old, recent):
        path.write_bytes(b"x")
    os.utime(old, (month, month))
    os.utime(current, (month, month))
    assert build.build(tmp_path, tier) == current
    assert not old.exists() and recent.exists() and current.stat().st_mtime > month + 86400


@needs_native
def test_prefill_silu_mul_and_rope_round_as_the_reference():
    """Prefill's SiLU * up and text RoPE in one native pass each (bf16): RoPE bit for bit the
    reference's ops (each product rounded, then the sum), on a transposed [1, H, T, D] view;
    SiLU * up within one bf16 rounding of torch's (their exponentials differ in the last float
    bits) and equal almost everywhere; float32 rows too."""
    from qvl.model.rope import apply_rotary

    torch.manual_seed(5)
    x = torch.randn(1, 37, 4, 128).bfloat16().transpose(1, 2)  # [1, H, T, D], tokens H*D apart
    cos, sin = torch.randn(1, 1, 37, 128).bfloat16(), torch.randn(1, 1, 37, 128).bfloat16()
    x[0, 1, 3, :64] = -0.0  # a negated +0 is -0, as the reference's
    x[0, 1, 3, 64:] = 0.0
    got, want = elementwise.text_rope(lib, x, cos, sin), apply_rotary(x, cos, sin)
    assert got.shape == x.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert elementwise.text_rope(lib, x, cos.float(), sin.float()) is None  # mixed dtypes: the caller's path
    for dtype in (torch.bfloat16, torch.float32):
        g, u = (torch.randn(300, 515) * 4).to(dtype), torch.randn(300, 515).to(dtype)  # a scalar tail
        want = F.silu(g) * u
        out = elementwise.silu_mul(lib, g.clone(), u)
        torch.testing.assert_close(out, want, rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
        assert (out == want).float().mean() > (0.99 if dtype == torch.bfloat16 else 0.5)
    with pytest.raises(ValueError, match="one shape"):
        elementwise.silu_mul(lib, g, u[:10])
