"""Parity with transformers' Qwen3VLForConditionalGeneration on tiny random checkpoints:
vision and DeepStack features, logits, and greedy continuations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
from tests.reference import load_reference, reference_inputs


def noise_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def two_image_request(max_new_tokens: int = 40) -> Request:
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": [
            {"type": "image", "image": noise_image(200, 330, 1)},  # non-square
            {"type": "text", "text": "Compare this picture"},
            {"type": "image", "image": noise_image(96, 64, 2)},
            {"type": "text", "text": "with this one. 请描述。"},
        ]},
    ]
    return Request(messages, SamplingParams(temperature=0, max_new_tokens=max_new_tokens))


SLOW = pytest.mark.slow  # two more checkpoints written, each with its transformers reference


@pytest.fixture(scope="module", params=["tiny_checkpoint", pytest.param("tiny_untied_checkpoint", marks=SLOW),
                                        pytest.param("tiny_moe_checkpoint", marks=SLOW)])
def pair(request):
    path = request.getfixturevalue(request.param)
    engine = Engine.load(EngineOptions(model=str(path), weights="fp32", threads=2, max_image_tokens=64))
    return engine, load_reference(path)


def test_configs_differ(tiny_checkpoint, tiny_untied_checkpoint):
    from qvl.config import ModelConfig

    a = ModelConfig.from_file(tiny_checkpoint / "config.json")
    b = ModelConfig.from_file(tiny_untied_checkpoint / "config.json")
    assert a.tie_word_embeddings and not b.tie_word_embeddings
    assert a.vision.deepstack_visual_indexes != b.vision.deepstack_visual_indexes


@torch.inference_mode()
def test_vision_and_deepstack_features_match(pair):
    engine, ref = pair
    parsed = engine.parse(two_image_request())
    assert len(parsed.images) == 2 and parsed.images[0].grid_thw[1] != parsed.images[0].grid_thw[2]
    from qvl.stream import Timings

    prompt = engine.prepare(parsed, Timings())
    ours_embeds, ours_deepstack = prompt.image_embeds, prompt.deepstack
    kw = reference_inputs(parsed, engine.cfg.image_token_id)
    out = ref.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"], return_dict=True)
    torch.testing.assert_close(ours_embeds, torch.cat(out.pooler_output), atol=1e-4, rtol=1e-4)
    assert len(ours_deepstack) == len(out.deepstack_features) == len(engine.cfg.vision.deepstack_visual_indexes)
    for ours, theirs in zip(ours_deepstack, out.deepstack_features):
        torch.testing.assert_close(ours, torch.cat(theirs), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_grid_tables_are_kept_per_grid_within_their_byte_budget(pair, monkeypatch):
    """The position embeddings and RoPE tables of a grid are computed once and reused (the
    interpolation costs ~30 ms per 1008-patch image on an 8B tower): a repeated image gives
    the same features bit for bit, and the kept tables stay within GRID_TABLES_BYTES, the
    most recently used grid always kept."""
    from qvl.model import vision

    engine, _ = pair
    visual = engine.model.visual
    parsed = engine.parse(two_image_request())
    patches = [image.pixel_values for image in parsed.images]
    grids = [tuple(image.grid_thw) for image in parsed.images]
    visual._grid_tables.clear()
    first = visual(torch.cat(patches), grids)[0]
    assert list(visual._grid_tables) == grids
    torch.testing.assert_close(visual(torch.cat(patches), grids)[0], first, rtol=0, atol=0)
    monkeypatch.setattr(vision, "GRID_TABLES_BYTES", 1)  # room for one grid's tables only
    visual(patches[1], grids[1:])
    assert list(visual._grid_tables) == grids[1:]
    alone = visual(patches[0], grids[:1])[0]  # computed again after eviction
    torch.testing.assert_close(alone, first[: len(alone)], rtol=0, atol=0)
    assert list(visual._grid_tables) == grids[:1]


@torch.inference_mode()
def test_logits_match(pair):
    from qvl.generate import new_cache, prefill
    from qvl.stream import Timings

    engine, ref = pair
    parsed = engine.parse(two_image_request())
    prompt = engine.prepare(parsed, Timings())
    cache = new_cache(engine.model, 1, len(prompt) + 1)
    ours = prefill(engine.model, cache, prompt, chunk=37)  # several chunks, split inside images
    theirs = ref(**reference_inputs(parsed, engine.cfg.image_token_id)).logits[:, -1]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_greedy_continuation_identical(pair):
    engine, ref = pair
    parsed = engine.parse(two_image_request(max_new_tokens=40))
    done = engine.generate(parsed)
    kw = reference_inputs(parsed, engine.cfg.image_token_id)
    with torch.inference_mode():
        out = ref.generate(**kw, max_new_tokens=40, do_sample=False, repetition_penalty=1.0,
                           eos_token_id=list(engine.defaults.eos_token_ids), pad_token_id=151643)
    theirs = out[0, parsed.ids.shape[0]:].tolist()
    assert len(done.token_ids) >= 32
    assert done.token_ids == theirs


def test_logprobs_are_the_reference_log_softmax(pair):
    """Each generated token's logprob and its 5 best alternatives equal log_softmax of
    transformers' logits at that step (float32)."""
    engine, ref = pair
    request = two_image_request(max_new_tokens=4)
    request.sampling = SamplingParams(temperature=0, max_new_tokens=4, logprobs=5, ignore_eos=True)
    parsed = engine.parse(request)
    done = engine.generate(parsed)
    kw = reference_inputs(parsed, engine.cfg.image_token_id)
    with torch.inference_mode():
        out = ref.generate(**kw, max_new_tokens=4, do_sample=False, repetition_penalty=1.0, output_logits=True,
                           return_dict_in_generate=True, eos_token_id=None, pad_token_id=151643)
    assert out.sequences[0, parsed.ids.shape[0]:].tolist() == done.token_ids
    assert len(done.logprobs) == 4
    for ours, logits in zip(done.logprobs, out.logits):
        theirs = torch.log_softmax(logits[0].float(), -1)
        assert abs(ours.logprob - float(theirs[ours.token_id])) < 1e-4
        best = torch.topk(theirs, 5)
        assert [t for t, _ in ours.top] == best.indices.tolist()
        torch.testing.assert_close(torch.tensor([p for _, p in ours.top]), best.values, atol=1e-4, rtol=0)


def test_greedy_identical_with_and_without_kv_cache(tiny_engine):
    """Decoding with the cache gives exactly the tokens of re-running the whole
    sequence from scratch at every step."""
    from qvl.generate import PreparedPrompt, decode_step, new_cache, prefill
    from qvl.stream import Timings

    engine = tiny_engine
    request = Request([{"role": "user", "content": [{"type": "image", "image": noise_image(64, 96, 3)},
                                                    {"type": "text", "text": "Describe."}]}],
                      SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    parsed = engine.parse(request)
    prompt = engine.prepare(parsed, Timings())
    cache, cached = new_cache(engine.model, 1, len(prompt) + 12), []
    logits = prefill(engine.model, cache, prompt)
    for step in range(12):
        cached.append(int(logits.argmax(-1)))
        logits = decode_step(engine.model, cache, torch.tensor(cached[-1:]), torch.tensor([len(prompt) + step]),
                             torch.tensor([prompt.next_position + step]))
    ids, uncached = prompt.ids, []
    for step in range(12):
        extra = torch.arange(step).expand(3, -1) + prompt.next_position
        p = PreparedPrompt(ids, torch.cat([prompt.positions, extra], 1), 0, prompt.image_embeds, prompt.deepstack)
        logits = prefill(engine.model, new_cache(engine.model, 1, len(p)), p)
        token = int(logits.argmax(-1))
        uncached.append(token)
        ids = torch.cat([ids, torch.tensor([token])])
    assert cached == uncached


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", pytest.param("tiny_untied_checkpoint", marks=SLOW)])
def test_bf16_engine_stays_close_to_float32(checkpoint, request):
    """bf16 with every native kernel (fused vision GELU and RoPE, flash attention, decode
    kernels) against the float32 engine, which matches transformers: relative error of the
    image features and prompt logits within bf16's reach (measured ~0.75% and ~0.9%)."""
    from qvl.generate import new_cache, prefill
    from qvl.stream import Timings

    path = request.getfixturevalue(checkpoint)
    results = []
    for dtype in ("fp32", "bf16"):
        engine = Engine.load(EngineOptions(model=str(path), weights=dtype, dtype=dtype, threads=2, max_image_tokens=256))
        parsed = engine.parse(two_image_request())
        with torch.inference_mode():
            prompt = engine.prepare(parsed, Timings())
            logits = prefill(engine.model, new_cache(engine.model, 1, len(prompt) + 1), prompt)
        results.append((prompt.image_embeds.float(), logits.float()))
    (embeds, logits), (embeds16, logits16) = results
    assert (embeds16 - embeds).norm() / embeds.norm() < 0.012
    assert (logits16 - logits).norm() / logits.norm() < 0.015


@pytest.mark.slow  # writes a checkpoint, loads two engines
def test_vision_heads_of_72_take_the_bf16_flash_kernel(tmp_path, monkeypatch):
    """The 1152-wide towers' head size (16 heads of 72: 8B, 32B, 30B-A3B) on a tiny checkpoint
    (2 heads of 72): in bf16 the vision attention runs qvl's flash kernel where the CPU has it
    (AVX512-BF16 or AMX-BF16), and the image features stay within bf16's reach of float32."""
    from qvl.kernels import attention
    from qvl.kernels.plan import default_plan
    from qvl.stream import Timings
    from qvl.synth import write_checkpoint

    path = write_checkpoint(tmp_path / "wide", "tiny", seed=3,
                            changes={"vision_config": {"hidden_size": 144, "num_heads": 2, "intermediate_size": 288}})
    calls, flash = [], attention.attention

    def counted(lib, q, *args, **kwargs):  # head sizes the kernel took (None: declined, SDPA runs)
        out = flash(lib, q, *args, **kwargs)
        if out is not None:
            calls.append(q.shape[-1])
        return out

    monkeypatch.setattr(attention, "attention", counted)
    features = []
    for dtype in ("fp32", "bf16"):
        engine = Engine.load(EngineOptions(model=str(path), weights=dtype, dtype=dtype, threads=2))
        assert engine.cfg.vision.head_dim == 72
        with torch.inference_mode():
            features.append(engine.prepare(engine.parse(two_image_request()), Timings()).image_embeds.float())
    if default_plan(torch.bfloat16).image_attention == "qvl_attention":
        assert calls and set(calls) == {72}  # the tower's attention, bf16 only: float32 takes SDPA
    assert (features[1] - features[0]).norm() / features[0].norm() < 0.012


def test_default_path_prefill_runs_an_integer_kernel(tiny_checkpoint, monkeypatch):
    """The production default (int8 weights, this CPU's default compute dtype: bf16 where it has
    BF16, else float32; native kernels) prefills a two-image prompt through qvl's integer kernel:
    8-bit activation codes per 64 columns where the CPU has VNNI without AMX, else 16-bit codes
    per row (on AMX int8 tiles where the CPU has them, else in 16-bit pairs on x86), and its
    logits stay within bf16's reach of the path without it (dequantise + oneDNN's GEMM). With
    8-bit codes the vision tower's linears take the same kernel (its norm, GELU and residual
    fused), so both sides here differ in the image features too."""
    from qvl.generate import new_cache, prefill
    from qvl.kernels import linear
    from qvl.stream import Timings

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, max_image_tokens=256))
    name = engine.model.language_model.layers[0].mlp.up_proj.plan.prefill.name
    if name not in ("amx_i16_linear", "q8_linear", "i16_linear"):
        pytest.skip("no integer prefill kernel runs on this CPU")
    kernel, calls = getattr(linear, name), []
    results = []
    for integer in (True, False):
        for other in {name, "i16_linear"}:  # without: no integer kernel at all
            monkeypatch.setattr(linear, other, (lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
                                if integer and other == name else (lambda *a, **kw: None))
        parsed = engine.parse(two_image_request())
        with torch.inference_mode():
            prompt = engine.prepare(parsed, Timings())
            results.append(prefill(engine.model, new_cache(engine.model, 1, len(prompt) + 1), prompt).float())
    assert calls  # many rows: the integer kernel ran
    with_codes, without = results
    if name == "q8_linear":  # 8-bit codes: the distance (2.7% apart here, on 64-wide layers)
        assert F.cosine_similarity(with_codes.flatten(), without.flatten(), 0) > 0.999
    else:
        assert (with_codes - without).norm() / without.norm() < 0.02  # measured 0.8% (AMX)
