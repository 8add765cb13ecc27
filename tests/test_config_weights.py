"""Config parsing and strict checkpoint loading."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qvl.config import ConfigError, GenerationDefaults, ModelConfig
from qvl import runtime
from qvl.runtime import choose_dtype
from qvl.synth import OFFICIAL_2B, preset_config
from qvl.weights import CheckpointError, load_model


def test_official_2b_config_values():
    cfg = ModelConfig.from_dict(OFFICIAL_2B)
    assert cfg.vision.resize_factor == 32 and cfg.vision.patch_dim == 1536
    assert cfg.text.mrope_section == (24, 20, 20) and cfg.text.mrope_interleaved
    assert cfg.text.rope_theta == 5_000_000 and cfg.tie_word_embeddings
    assert cfg.vision.deepstack_visual_indexes == (5, 11, 17)


def test_transformers5_rope_parameters_layout_is_read():
    d = copy.deepcopy(OFFICIAL_2B)
    rope = d["text_config"].pop("rope_scaling")
    d["text_config"]["rope_parameters"] = {**rope, "rope_theta": d["text_config"].pop("rope_theta")}
    assert ModelConfig.from_dict(d) == ModelConfig.from_dict(OFFICIAL_2B)


def test_unsupported_model_type_is_named():
    d = {**OFFICIAL_2B, "model_type": "qwen2_5_vl"}
    with pytest.raises(ConfigError, match="qwen2_5_vl"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("section,key", [("text_config", "hidden_size"), ("vision_config", "patch_size"),
                                         ("vision_config", "deepstack_visual_indexes")])
def test_missing_architecture_field_is_an_error(section, key):
    d = copy.deepcopy(OFFICIAL_2B)
    del d[section][key]
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(d)


def test_generation_defaults():
    g = GenerationDefaults.from_dict({"eos_token_id": [151645, 151643], "do_sample": True, "top_k": 20,
                                      "top_p": 0.8, "temperature": 0.7})
    assert g.eos_token_ids == (151645, 151643) and g.max_new_tokens == 1024 and g.temperature == 0.7
    assert GenerationDefaults.from_dict({"eos_token_id": 2, "do_sample": False}).temperature == 0


def test_dtype_follows_cpu_features():
    assert choose_dtype("auto", native_bf16=True) == torch.bfloat16
    assert choose_dtype("auto", native_bf16=False) == torch.float32
    assert choose_dtype("fp32") == torch.float32


def _fake_topology(root, siblings: dict[int, str]):
    for cpu, text in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return root


def test_default_threads_count_cores_not_hardware_threads(tmp_path, monkeypatch):
    """A hybrid laptop CPU: 6 P-cores with two threads each (CPUs 0-11, siblings 2k and 2k+1) and 8
    E-cores with one (12-19): the default is one thread per core, 14 (dividing the allowed CPUs by
    logical // physical = 20 // 14 = 1 gave 20); restricted to some CPUs, the cores among them."""
    siblings = {c: f"{c - c % 2}-{c - c % 2 + 1}" for c in range(12)} | {c: str(c) for c in range(12, 20)}
    root = _fake_topology(tmp_path / "cpu", siblings)
    monkeypatch.setattr(runtime, "allowed_cpus", lambda: list(range(20)))
    assert runtime.physical_cores(root) == 14
    monkeypatch.setattr(runtime, "allowed_cpus", lambda: [0, 1, 2, 12, 13])
    assert runtime.physical_cores(root) == 4  # cores {0,1}, {2,3}, 12 and 13
    # without the topology files (another OS): allowed CPUs scaled by cores / logical CPUs
    monkeypatch.setattr(runtime, "allowed_cpus", lambda: list(range(20)))
    import psutil
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 20 if logical else 14)
    assert runtime.physical_cores(tmp_path / "missing") == 14


def _copy_without_weights(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    return load_file(src / "model.safetensors")


def test_missing_and_unexpected_tensors_are_listed(tiny_checkpoint, tmp_path):
    state = _copy_without_weights(tiny_checkpoint, tmp_path / "m")
    del state["model.language_model.layers.0.mlp.up_proj.weight"]
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    cfg = ModelConfig.from_file(tmp_path / "m" / "config.json")
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "m", cfg, torch.float32)
    message = str(err.value)
    assert "1 missing tensors: language_model.layers.0.mlp.up_proj.weight" in message
    assert "1 unexpected tensors: model.extra.weight" in message


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoint, tmp_path):
    state = _copy_without_weights(tiny_checkpoint, tmp_path / "s")
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / "s" / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "s" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    a = load_model(tiny_checkpoint, cfg, torch.bfloat16).state_dict()
    b = load_model(tmp_path / "s", cfg, torch.bfloat16).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_file_loads_as_fp32_and_tied_head_shares_storage(tiny_checkpoint):
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    model = load_model(tiny_checkpoint, cfg, torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.language_model.embed_tokens.weight.data_ptr()


def test_transformers_loads_our_synthetic_checkpoint_strictly(tiny_untied_checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    _, info = Qwen3VLForConditionalGeneration.from_pretrained(tiny_untied_checkpoint, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_2b_preset_has_published_parameter_count():
    from qvl.model.qwen3_vl import Qwen3VL

    with torch.device("meta"):
        model = Qwen3VL(ModelConfig.from_dict(preset_config("2b")))
        model.tie_weights()
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.visual.parameters())
    assert 2.10e9 < total < 2.16e9 and 0.40e9 < vision < 0.42e9
