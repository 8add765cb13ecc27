"""Qwen3.5/3.6 (hybrid Gated DeltaNet + gated attention): parity with transformers'
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration on tiny random
checkpoints (images, video, a long prompt prefilled in slices, a conversation), the
recurrent state through the scheduler (snapshots in the prefix cache, forks, preemption,
rows decoded together), and bad checkpoints refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from qvl.bench import synthetic_clip
from qvl.config import ConfigError, ModelConfig
from qvl.engine import Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
from qvl.weights import CheckpointError
from tests.reference import load_reference, reference_inputs, reference_inputs_video

WORDS = ("the river crosses a quiet valley where farmers grow rice and tea under old trees while children "
         "count the boats that pass").split()


def noise_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def long_text(words: int, seed: int = 0) -> str:
    rng = np.random.RandomState(seed)
    return " ".join(WORDS[i] for i in rng.randint(0, len(WORDS), words))


def greedy(messages, max_new_tokens: int = 24, **sampling) -> Request:
    return Request(messages, SamplingParams(temperature=0, max_new_tokens=max_new_tokens, **sampling))


def image_question(question: str, system: str = "You are a careful assistant.") -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image", "image": noise_image(200, 330, 1)},
                                         {"type": "text", "text": question}]}]


def reference_tokens(engine, ref, parsed, n: int, video: bool = False) -> list[int]:
    kw = reference_inputs_video(parsed, engine.cfg) if video else reference_inputs(parsed, engine.cfg.image_token_id)
    with torch.inference_mode():
        out = ref.generate(**kw, max_new_tokens=n, do_sample=False, repetition_penalty=1.0,
                           eos_token_id=list(engine.defaults.eos_token_ids), pad_token_id=248044)
    return out[0, parsed.ids.shape[0]:].tolist()


@pytest.fixture(scope="module", params=["qwen3.5-tiny", pytest.param("qwen3.5-tiny-moe", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    from qvl.synth import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=4)
    engine = Engine.load(EngineOptions(model=str(path), weights="fp32", threads=2, max_image_tokens=64))
    return engine, load_reference(path)


def test_two_images_greedy_tokens_match_transformers(pair):
    engine, ref = pair
    messages = image_question("Compare this picture")
    messages[1]["content"] += [{"type": "image", "image": noise_image(96, 64, 2)},
                               {"type": "text", "text": "with this one. 请描述。"}]
    parsed = engine.parse(greedy(messages, 30))
    done = engine.generate(parsed)
    assert len(parsed.images) == 2 and len(done.token_ids) >= 24
    assert done.token_ids == reference_tokens(engine, ref, parsed, 30)


def test_a_clip_greedy_tokens_match_transformers(pair, tmp_path):
    engine, ref = pair
    clip = synthetic_clip(tmp_path / "clip.mp4", 2.3, 200, 120, fps=10)
    parsed = engine.parse(greedy([{"role": "user", "content": [{"type": "video", "video": str(clip)},
                                                              {"type": "text", "text": "What happens?"}]}]))
    assert sum(u.video for u in parsed.images) >= 2  # several frame pairs, each placed as an image
    assert engine.generate(parsed).token_ids == reference_tokens(engine, ref, parsed, 24, video=True)


def test_a_long_prompt_prefilled_in_slices_matches_transformers(pair):
    """Over 2,000 tokens: the scheduler prefills them in several calls, the delta rule's state
    carried from one to the next."""
    engine, ref = pair
    parsed = engine.parse(greedy(image_question(long_text(2300) + " What is in the picture?")))
    assert len(parsed.ids) > 2100
    scheduler = engine.scheduler
    calls = []
    original = scheduler._prefill_call
    scheduler._prefill_call = lambda seq, start, end: calls.append((start, end)) or original(seq, start, end)
    try:
        done = engine.generate(parsed)
    finally:
        del scheduler._prefill_call
    assert len(calls) >= 2
    assert done.token_ids == reference_tokens(engine, ref, parsed, 24)


def test_a_conversation_matches_transformers(pair):
    engine, ref = pair
    messages = image_question("What is this?") + [
        {"role": "assistant", "content": "A photo of noise."},
        {"role": "user", "content": "And what colour is it mostly?"}]
    parsed = engine.parse(greedy(messages))
    assert engine.generate(parsed).token_ids == reference_tokens(engine, ref, parsed, 24)


# -- the recurrent state through the scheduler (the default path: int8 weights, native kernels) ---

def test_a_new_conversation_about_the_same_image_resumes_from_a_snapshot_exactly(tiny35_checkpoint):
    """A second (long) question about the same system prompt and image starts from the recurrent
    state kept where the first one's question began, and prefills only the rest; its answer and log-probabilities are
    those of a full prefill (an engine without a prefix cache), to the bit."""
    system = "You read documents for a living. " + long_text(300, seed=1)
    cached = Engine.load(EngineOptions(model=str(tiny35_checkpoint), threads=2))
    fresh = Engine.load(EngineOptions(model=str(tiny35_checkpoint), threads=2, prefix_cache_mb=0))
    first = cached.generate(greedy(image_question("What is in the picture? " + long_text(100, seed=2), system),
                                   logprobs=3))
    assert first.timings.reused_tokens == 0
    request = greedy(image_question("Which colours do you see? " + long_text(100, seed=3), system), logprobs=3)
    second, alone = cached.generate(request), fresh.generate(request)
    parsed = cached.parse(request)
    question = int((parsed.ids == cached.tokenizer.token_id("<|im_start|>")).nonzero()[-2])
    assert second.timings.reused_tokens == question // 64 * 64  # all before the question, to a snapshot
    assert second.token_ids == alone.token_ids
    assert [(p.token_id, p.logprob, p.top) for p in second.logprobs] == \
           [(p.token_id, p.logprob, p.top) for p in alone.logprobs]


def test_a_turn_leaves_a_snapshot_inside_its_answer_for_the_next_turn(tiny35_engine):
    """At the end of a turn the state at the last multiple of SNAPSHOT_INTERVAL that decoding
    passed is kept after the answer's blocks, so a follow-up that repeats the answer's tokens
    prefills only from there."""
    from qvl.kv_cache import block_hashes
    from qvl.state_cache import SNAPSHOT_BLOCKS, SNAPSHOT_INTERVAL

    engine = tiny35_engine
    parsed = engine.parse(greedy(image_question("Describe the picture. " + long_text(40, seed=2)), 150,
                                 ignore_eos=True))
    done = engine.generate(parsed)
    fed = torch.cat([parsed.ids, torch.tensor(done.token_ids[:-1])])  # the last token is never fed
    passed = len(fed) // SNAPSHOT_INTERVAL * SNAPSHOT_BLOCKS
    assert passed * 16 > len(parsed.ids)  # inside the answer
    digests = block_hashes(fed, engine.spans(parsed), passed, salt=parsed.cache_salt)
    assert digests[-1] in engine.prefix_cache.snapshots


def test_snapshots_live_within_the_prefix_cache_budget(tiny35_checkpoint):
    engine = Engine.load(EngineOptions(model=str(tiny35_checkpoint), threads=2, prefix_cache_mb=1))
    pool = engine.prefix_cache
    for i in range(4):
        engine.generate(greedy(image_question(long_text(200, seed=10 + i)), 4))
        assert pool.snapshots and len(pool.unused) * pool.block_bytes + pool.snapshot_bytes <= pool.max_bytes
    assert all(digest in pool.by_hash for digest in pool.snapshots)  # a snapshot goes with its block


def test_answers_do_not_depend_on_other_rows(tiny35_engine):
    """Forked answers (n) share the prompt's state and then each keeps its own; rows decoded
    together give what each gives alone."""
    engine = tiny35_engine
    requests = [greedy(image_question(f"Question {i}: " + long_text(20 + 30 * i, seed=i)), 16) for i in range(3)]
    alone = [engine.generate(r).token_ids for r in requests]
    together = engine.generate_batch(requests)
    assert [d.token_ids for d in together] == alone
    forked = [e for e in engine.stream(greedy(requests[0].messages, 16, n=3)) if hasattr(e, "finish_reason")]
    assert sorted(d.index for d in forked) == [0, 1, 2]
    assert all(d.token_ids == alone[0] for d in forked)


def test_a_preempted_row_goes_on_as_if_never_stopped(tiny35_checkpoint):
    requests = [greedy([{"role": "user", "content": long_text(150, seed=i)}], 48, ignore_eos=True) for i in range(3)]
    roomy = Engine.load(EngineOptions(model=str(tiny35_checkpoint), threads=2, prefix_cache_mb=0))
    alone = [roomy.generate(r).token_ids for r in requests]
    # room for the three prompts but not for all three answers: the newest is preempted
    prompts = [len(roomy.parse(r).ids) for r in requests]
    blocks = sum(-(-n // 16) for n in prompts) + 4
    tight = Engine.load(EngineOptions(model=str(tiny35_checkpoint), threads=2, prefix_cache_mb=0,
                                      kv_cache_mb=blocks * roomy.prefix_cache.block_bytes / 2**20))
    assert [d.token_ids for d in tight.generate_batch(requests)] == alone
    assert tight.scheduler.preemptions > 0


# -- checkpoints ----------------------------------------------------------------------------------

def config_with(path, change) -> dict:
    config = json.loads((path / "config.json").read_text())
    change(config["text_config"])
    return config


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("layer_types"), "missing the required field 'layer_types'"),
    (lambda t: t["layer_types"].__setitem__(1, "mamba"), "unknown layer kind 'mamba'"),
    (lambda t: t["layer_types"].pop(), "layer_types lists 3 layers, num_hidden_layers is 4"),
    (lambda t: t.update(linear_num_value_heads=3), "must be a multiple of linear_num_key_heads"),
    (lambda t: t.pop("linear_key_head_dim"), "missing the required field 'linear_key_head_dim'"),
], ids=["no-layer-types", "unknown-kind", "wrong-count", "heads", "no-head-dim"])
def test_bad_hybrid_configs_are_refused_by_name(tiny35_checkpoint, change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(config_with(tiny35_checkpoint, change))


def test_state_sizes_that_do_not_fit_the_weights_are_refused(tiny35_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny35_checkpoint, broken)
    config = config_with(broken, lambda t: t.update(linear_value_head_dim=16))
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"linear_attn\..*checkpoint .* vs config"):
        Engine.load(EngineOptions(model=str(broken), threads=2))


def test_a_checkpoint_with_a_multi_token_prediction_head_loads_and_keeps_it(tiny35_checkpoint, tmp_path):
    with_mtp = tmp_path / "mtp"
    shutil.copytree(tiny35_checkpoint, with_mtp)
    shard = next(with_mtp.glob("model*.safetensors"))
    tensors = load_file(shard)
    tensors["mtp.fc.weight"] = torch.randn(128, 256).to(torch.bfloat16)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(8, 128).to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    engine = Engine.load(EngineOptions(model=str(with_mtp), threads=2))
    assert set(engine.model.mtp) == {"mtp.fc.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight"}
    assert engine.generate(greedy([{"role": "user", "content": "Hi"}], 4)).token_ids


# -- front doors ----------------------------------------------------------------------------------

def test_the_http_apis_answer_with_reasoning_apart_and_the_switch(tiny35_engine):
    import base64
    import io

    from fastapi.testclient import TestClient

    from tests.test_server_api import make_app, wait_ready

    png = io.BytesIO()
    noise_image(64, 96, 5).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    body = {"model": "qvl", "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0}
    with TestClient(make_app(tiny35_engine)) as client:
        wait_ready(client)
        thinking = client.post("/v1/chat/completions", json=body).json()
        assert thinking["choices"][0]["message"]["reasoning_content"]  # the template opens <think> by default
        plain = client.post("/v1/chat/completions",
                            json={**body, "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert not plain["choices"][0]["message"].get("reasoning_content")
        assert plain["usage"]["prompt_tokens"] == thinking["usage"]["prompt_tokens"] + 2  # `\n</think>\n\n` minus `\n`
        chunks = client.post("/v1/chat/completions", json={**body, "stream": True}).text
        assert chunks.rstrip().endswith("data: [DONE]")
        ollama = client.post("/api/chat", json={"model": "qvl", "stream": False, "think": False,
                                                "messages": [{"role": "user", "content": "Hi", "images": [
                                                    url.split(",", 1)[1]]}], "options": {"num_predict": 6}}).json()
        assert ollama["done"] and "thinking" not in ollama["message"]
        shown = client.post("/api/show", json={"model": "qvl"}).json()
        assert shown["model_info"]["general.architecture"] == "qwen35" and "thinking" in shown["capabilities"]


def test_qvl_ask_runs_a_qwen3_5_checkpoint(tiny35_checkpoint, tmp_path, capsys):
    from qvl.cli import main

    picture = tmp_path / "p.png"
    noise_image(64, 64, 6).save(picture)
    assert main(["ask", "What is this?", "-i", str(picture), "--model", str(tiny35_checkpoint), "--no-think",
                 "--max-new-tokens", "5", "--temperature", "0", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["usage"]["completion_tokens"] == 5 and not answer.get("reasoning")


@pytest.mark.parametrize("start, end, turn, points", [
    (0, 100, None, [64]),
    (0, 63, None, []),
    (64, 128, None, [128]),  # a call starting at a snapshot keeps the next
    (0, 2500, 1500, [1024, 1472, 2048, 2496]),
    (1000, 1100, 1010, [1024, 1088]),  # the turn's point (960) lies before the call: an earlier one kept it
])
def test_capture_points(start, end, turn, points):
    from qvl.state_cache import capture_points

    assert capture_points(start, end, turn) == points


# -- each CPU tier ---------------------------------------------------------------------------------

TIER_PROBE = """
import sys, torch
from qvl.engine import Engine, EngineOptions, Request
from qvl.generate import new_cache, prefill
from qvl.sampling import SamplingParams
from qvl.stream import Timings
engine = Engine.load(EngineOptions(model=sys.argv[1], weights=sys.argv[2], dtype=sys.argv[3], threads=2))
messages = [{"role": "user", "content": "Count the rivers: " + " ".join(["one two three"] * 60)}]
parsed = engine.parse(Request(messages, SamplingParams(temperature=0, max_new_tokens=8)))
prompt = engine.prepare(parsed, Timings())
logits = prefill(engine.model, new_cache(engine.model, 1, len(prompt) + 1), prompt, chunk=70)
torch.save({"logits": logits[0].float(), "plan": {kind: k.name for kind, k in engine.plan.entries().items()}},
           sys.argv[4])
"""


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx512", "avx2", "portable"])
def test_every_tier_runs_the_hybrid_layers_natively_within_int8s_error(tiny35_checkpoint, tier, tmp_path):
    """Each emulated tier's default path (int8 weights, its compute dtype and kernels) gives the
    float32 model's prefill logits within the error of int8 weights alone (computed in float32),
    its plan naming native Gated DeltaNet kernels."""
    import os
    import subprocess
    import sys

    from qvl.kernels import build

    if tier not in {t.name for t in build.tiers()}:
        pytest.skip(f"this CPU cannot run the {tier} tier")
    outputs = {}
    for name, weights, dtype, env in (("fp32", "fp32", "auto", {}), ("int8", "int8", "fp32", {}),
                                      (tier, "int8", "auto", {"QVL_ISA": tier})):
        out = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", TIER_PROBE, str(tiny35_checkpoint), weights, dtype, str(out)],
                       check=True, env={**os.environ, **env}, timeout=600)
        outputs[name] = torch.load(out)
    reference = outputs["fp32"]["logits"]

    def error(name: str) -> float:
        return float((outputs[name]["logits"] - reference).norm() / reference.norm())

    assert error(tier) < 1.25 * error("int8") + 0.01
    plan = outputs[tier]["plan"]
    assert all(plan[kind].startswith("qvl_") for kind in ("delta rule, prefill", "delta rule, decode",
                                                            "short conv, prefill", "short conv, decode"))


def test_the_mixture_runs_int4_with_int8_where_groups_do_not_divide(tmp_path):
    """The tiny mixture's shared expert has 64 inputs to its down projection: less than one
    group of 128, so that linear is int8 while the rest is int4."""
    from qvl.quantize import Int4Linear, Int8Linear
    from qvl.synth import write_checkpoint

    path = write_checkpoint(tmp_path / "moe", "qwen3.5-tiny-moe", seed=5)
    engine = Engine.load(EngineOptions(model=str(path), weights="int4", threads=2, quant_cache=False))
    mlp = engine.model.language_model.layers[0].mlp
    assert isinstance(mlp.shared_expert.down_proj, Int8Linear) and isinstance(mlp.shared_expert.up_proj, Int4Linear)
    assert len(engine.generate(greedy([{"role": "user", "content": "Hi"}], 6, ignore_eos=True)).token_ids) == 6
