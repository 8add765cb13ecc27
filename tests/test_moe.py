"""Mixture of experts (Qwen3VLMoe, 30B-A3B's layout) on a tiny checkpoint: the routing rule,
the layer rule, int8 experts, the default production path (int8 weights and experts, bf16
compute, the router unquantised) and its sizing. Parity with transformers' Qwen3VLMoe (vision, logits, greedy
tokens, logprobs) runs in test_model_parity.py."""

from __future__ import annotations

import pytest
import torch

from qvl.config import ConfigError, ModelConfig, TextConfig
from qvl.engine import Engine, EngineOptions, Request
from qvl.model.text import SparseMoE
from qvl.quantize import Int8Experts, Int8Linear
from qvl.sampling import SamplingParams
from qvl.sizing import footprint
from qvl.synth import preset_config


def moe_text(**changes) -> TextConfig:
    return ModelConfig.from_dict(preset_config("tiny-moe", {"text_config": changes})).text


def test_which_layers_have_experts():
    assert [moe_text().is_moe_layer(i) for i in range(4)] == [True] * 4
    assert [moe_text(decoder_sparse_step=2).is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert [moe_text(mlp_only_layers=[0, 3]).is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    assert not ModelConfig.from_dict(preset_config("tiny")).text.is_moe_layer(0)  # dense
    with pytest.raises(ConfigError, match="num_experts_per_tok 17"):
        moe_text(num_experts_per_tok=17)


@pytest.mark.parametrize("preset", ["tiny-moe", "qwen3.5-tiny-moe"])
def test_num_local_experts_is_the_expert_count(preset):
    """Newer transformers saves the expert count as `num_local_experts`: still a MoE model."""
    raw = preset_config(preset)
    raw["text_config"]["num_local_experts"] = raw["text_config"].pop("num_experts")
    assert ModelConfig.from_dict(raw).text == ModelConfig.from_dict(preset_config(preset)).text


def test_routing_is_the_renormalised_top_k_of_the_softmax():
    """The grouped computation equals the definition: every expert on every token, weighted by
    the softmax over the chosen k renormalised to 1, zero for the others."""
    cfg = moe_text()
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 7, cfg.hidden_size)
    flat = x.reshape(-1, cfg.hidden_size)
    probs = torch.softmax(moe.gate(flat).float(), -1)
    top = probs.topk(cfg.num_experts_per_tok, -1)
    weights = torch.zeros_like(probs).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    every = torch.stack([moe.experts(flat, e) for e in range(cfg.num_experts)], 1)  # [N, E, H]
    expected = (weights[..., None] * every).sum(1).view_as(x)
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_experts_compute_what_their_float_weights_do(bits):
    from qvl.kernels.plan import default_plan
    from qvl.quantize import Int4Experts

    cfg = moe_text()
    float_experts = SparseMoE(cfg).experts
    torch.nn.init.normal_(float_experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(float_experts.down_proj, std=0.1)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    quantized = Int8Experts(e, h, i, torch.float32) if bits == 8 else Int4Experts(e, h, i, 16, torch.float32)
    for leaf in ("gate_up_proj", "down_proj"):
        state = quantized.state("x", leaf, getattr(float_experts, leaf).data, torch.float32, stored=False)
        for key, tensor in state.items():
            setattr(quantized, key.split(".", 1)[1], tensor)
    assert quantized.gate_up_proj.dtype == (torch.int8 if bits == 8 else torch.uint8)
    quantized.use_plan(default_plan(torch.float32), "text")  # a decoder layer's kernels, as loading gives them
    x = torch.randn(5, cfg.hidden_size)
    for expert in (0, 7, 15):
        want, got = float_experts(x, expert), quantized(x, expert)
        assert ((got - want).norm() / want.norm()) < (0.02 if bits == 8 else 0.15)  # per row / per group of 16
        # one row (the native GEMV) and many rows (dequantise + GEMM) agree
        torch.testing.assert_close(quantized(x[:1], expert), got[:1], atol=1e-4, rtol=1e-3)


@pytest.mark.slow  # four int4 engines on a new checkpoint
def test_int4_experts_where_the_group_divides_their_sizes(tmp_path):
    from qvl.quantize import Int4Experts
    from qvl.synth import write_checkpoint

    path = write_checkpoint(tmp_path / "moe96", "tiny-moe", seed=3, changes={"text_config": {"moe_intermediate_size": 96}})
    request = Request([{"role": "user", "content": "Tell me a story."}], SamplingParams(temperature=0,
                                                                                    max_new_tokens=8))
    answers = []
    for group, kind in ((32, Int4Experts), (64, Int8Experts)):  # 96 inputs: groups of 32 divide them, of 64 not
        engine = Engine.load(EngineOptions(model=str(path), weights="int4", group_size=group, dtype="fp32", threads=2))
        experts = engine.model.language_model.layers[0].mlp.experts
        assert type(experts) is kind
        answers.append(engine.generate(request).token_ids)
        again = Engine.load(EngineOptions(model=str(path), weights="int4", group_size=group, dtype="fp32", threads=2))
        assert again.generate(request).token_ids == answers[-1]  # from the quantised-weights cache
    assert all(len(a) == 8 for a in answers)


@pytest.mark.slow  # quantises a mixture-of-experts checkpoint, loads it twice
def test_the_default_path_quantises_the_experts_not_the_router_and_reloads_the_same(tiny_moe_checkpoint):
    def answer(engine):
        request = Request([{"role": "user", "content": "Tell me a story."}], SamplingParams(temperature=0,
                                                                                        max_new_tokens=12))
        return engine.generate(request).token_ids

    first = Engine.load(EngineOptions(model=str(tiny_moe_checkpoint), threads=2))  # int8, the CPU's dtype
    layer = first.model.language_model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int8Linear)
    assert not isinstance(layer.mlp.gate, Int8Linear)  # the router keeps the reference's top-k choice
    assert layer.mlp.experts.gate_up_proj.dtype == torch.int8
    tokens = answer(first)
    assert len(tokens) == 12
    again = Engine.load(EngineOptions(model=str(tiny_moe_checkpoint), threads=2))  # from the quantised-weights cache
    assert answer(again) == tokens


def test_sizing_counts_every_expert_held_and_the_chosen_ones_read():
    cfg = ModelConfig.from_dict(preset_config("30b-a3b"))
    bf16, int8, int4 = (footprint(cfg, w) for w in ("bf16", "int8", "int4"))
    assert 61.5e9 < bf16.total_bytes < 62.5e9  # 31.07 B parameters
    assert 30.5e9 < int8.total_bytes < 32.5e9 and int8.read_per_token < 0.55 * bf16.read_per_token
    assert int4.total_bytes < 18e9  # fits a 24 GB machine
    t = cfg.text
    experts = t.num_hidden_layers * t.num_experts * 3 * t.hidden_size * t.moe_intermediate_size * 2
    assert bf16.read_per_token > experts * t.num_experts_per_tok // t.num_experts  # plus attention and the head
    assert bf16.read_per_token < 7e9  # ~3.3 B active parameters
