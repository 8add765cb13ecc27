"""The native kernels that are not weight-format specific: vision attention and the
int8 x int8 GEMM around torch._int_mm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qvl import native
from qvl.model.vision import image_attention

lib = native.library()
needs_native = pytest.mark.skipif(lib is None, reason="native kernels not built (no C compiler)")
needs_attention = pytest.mark.skipif(lib is None or not lib.qvl_has_attention(), reason="no AVX512-BF16 kernel")


def _reference_attention(q, k, v):
    return F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)


@needs_attention
@settings(max_examples=25, deadline=None)
@given(s=st.integers(1, 200), h=st.integers(1, 4), d=st.sampled_from([64, 128]), scale=st.floats(0.1, 4.0))
def test_attention_matches_float_reference(s, h, d, scale):
    qkv = (torch.randn(s, 3, h, d) * scale).bfloat16()
    q, k, v = qkv.unbind(1)  # strided rows, as the vision tower's fused qkv gives them
    out = native.attention(lib, q, k, v)
    ref = _reference_attention(q, k, v)
    assert out.shape == (s, h, d) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * max(1.0, ref.abs().max().item()), rtol=2e-2)


@needs_attention
def test_attention_declines_what_it_does_not_cover():
    q = torch.randn(10, 2, 80).bfloat16()
    assert native.attention(lib, q, q, q) is None  # head_dim 80
    assert native.attention(lib, q[..., :64].float(), q[..., :64].float(), q[..., :64].float()) is None  # fp32
    x = torch.randn(10, 2, 64)
    torch.testing.assert_close(image_attention(x, x, x), _reference_attention(x, x, x))  # SDPA takes over


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activation_matmul_close_to_float(dtype):
    x = torch.randn(40, 256).to(dtype)
    w = torch.randint(-127, 128, (96, 256), dtype=torch.int8)
    scale, bias = (torch.rand(96) / 50).to(dtype), torch.randn(96).to(dtype)
    ref = F.linear(x.float(), w.float() * scale.float()[:, None], bias.float())
    out = native.int8_matmul(lib, x, w, scale, bias)
    assert out.dtype == dtype and out.shape == (40, 96)
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), 0) > 0.999
    torch.testing.assert_close(out.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=0)


@needs_native
def test_engine_option_switches_int8_layers_to_int8_activations(tiny_checkpoint):
    from qvl.engine import Engine, EngineOptions
    from qvl.quantize import Int8Linear

    plain = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", vision_int8=True, threads=1))
    fast = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", vision_int8=True, threads=1,
                                     int8_activations=True))
    layers = [m for m in fast.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.int8_activations for m in layers)
    assert plain.model_id != fast.model_id  # cached answers of one never serve the other
    layer, x = fast.model.visual.blocks[0].mlp.linear_fc1, torch.randn(50, 64).to(fast.model.dtype)
    ref = F.linear(x.float(), layer.dequantized().float(), layer.bias.float())
    assert F.cosine_similarity(layer(x).float().flatten(), ref.flatten(), 0) > 0.999
