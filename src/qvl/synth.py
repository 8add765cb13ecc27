"""Random-weight checkpoints in the exact layout of the official Hugging Face
Qwen3-VL checkpoints, for offline tests, demos and benchmarks (`qvl synth`)."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch
from qvl.config import HYBRID_MODEL_TYPES, ModelConfig
from qvl.model.qwen3_vl import Qwen3VL
from qvl.quantize import QuantSpec
from qvl.weights import NAME_PREFIXES, SHARD_BYTES, quantized_tensors, write_shards

# config.json of Qwen/Qwen3-VL-2B-Instruct as published.
OFFICIAL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
        "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

# The other dense sizes, as changes to the 2B config (../shared/NOTES.md: the published configs).
VISION_27 = {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152, "intermediate_size": 4304}
SIZE_CHANGES = {
    "4b": {"tie_word_embeddings": True, "vision_config": {"out_hidden_size": 2560}, "text_config": {
        "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32}},
    "8b": {"tie_word_embeddings": False, "vision_config": {**VISION_27, "out_hidden_size": 4096}, "text_config": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32}},
    "32b": {"tie_word_embeddings": False, "vision_config": {**VISION_27, "out_hidden_size": 5120}, "text_config": {
        "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64}},
}

# Qwen3-VL-30B-A3B (mixture of experts: every layer 128 experts, 8 per token; ../shared/NOTES.md).
MOE_30B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
    "vision_config": {**VISION_27, "out_hidden_size": 2048, "model_type": "qwen3_vl_moe"},
    "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048, "num_hidden_layers": 48,
                    "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "norm_topk_prob": True},
}
# The tiny test layout with experts: 16 of them, 4 per token (2 x 48 != 128 hidden: transformers tells
# the published expert layout from its own by shape).
TINY_MOE = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
    "vision_config": {"model_type": "qwen3_vl_moe"},
    "text_config": {"model_type": "qwen3_vl_moe_text", "num_experts": 16, "num_experts_per_tok": 4,
                    "moe_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "norm_topk_prob": True},
}

# The same layout shrunk for tests: the real vocabulary, tiny layers.
TINY_CHANGES = {
    "text_config": {
        "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_hidden_layers": 4, "num_key_value_heads": 2,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
    },
    "vision_config": {
        "deepstack_visual_indexes": [0, 1, 2], "depth": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_heads": 4, "out_hidden_size": 128,
    },
}

# -- Qwen3.5 / 3.6 (hybrid: three Gated DeltaNet layers, then one gated attention layer) ------


def hybrid_layers(n: int, interval: int = 4) -> list[str]:
    """layer_types of an n-layer Qwen3.5 decoder: every `interval`-th layer full attention."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


QWEN3_5_VISION = {
    "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02,
    "intermediate_size": 4096, "model_type": "qwen3_5", "num_heads": 16, "num_position_embeddings": 2304,
    "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
# config.json of a Qwen3.5-2B (the layout of the published ones: ../shared/NOTES.md)
QWEN3_5_2B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054, "tie_word_embeddings": True, "transformers_version": "5.2.0",
    "text_config": {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
        "eos_token_id": 248044, "dtype": "bfloat16", "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "num_attention_heads": 8, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "layer_types": hybrid_layers(24), "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": 248320,
    },
    "vision_config": QWEN3_5_VISION,
}
QWEN3_5_SIZES = {
    "qwen3.5-2b": {},
    "qwen3.5-0.8b": {"text_config": {"hidden_size": 1024, "intermediate_size": 3584},
                     "vision_config": {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12,
                                       "out_hidden_size": 1024}},
    "qwen3.5-4b": {"text_config": {"hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
                                   "num_attention_heads": 16, "num_key_value_heads": 4, "layer_types": hybrid_layers(32),
                                   "linear_num_value_heads": 32},
                   "vision_config": {"out_hidden_size": 2560}},
    "qwen3.5-9b": {"tie_word_embeddings": False, "text_config": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "layer_types": hybrid_layers(32), "linear_num_value_heads": 32},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096}},
    "qwen3.5-27b": {"tie_word_embeddings": False, "text_config": {
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "layer_types": hybrid_layers(64), "linear_num_value_heads": 48},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 5120}},
    "qwen3.5-35b-a3b": {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                        "tie_word_embeddings": False, "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "layer_types": hybrid_layers(40), "linear_num_value_heads": 32,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 2048,
                          "model_type": "qwen3_5_moe"}},
}
# The Qwen3.5 layout shrunk for tests: the real vocabulary, four tiny layers (three Gated
# DeltaNet, one attention), two key heads serving four value heads.
QWEN3_5_TINY = {
    "text_config": {
        "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "layer_types": hybrid_layers(4),
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
    "vision_config": {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128},
}
QWEN3_5_TINY_MOE = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "vision_config": {"model_type": "qwen3_5_moe"},
    "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": 16, "num_experts_per_tok": 4,
                    "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64},
}
QWEN3_5_GENERATION_CONFIG = {
    "bos_token_id": 248044, "pad_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044],
    "top_k": 20, "top_p": 0.95, "temperature": 0.6, "transformers_version": "5.2.0",
}

GENERATION_CONFIG = {
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
    "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.0, "temperature": 0.7, "transformers_version": "4.56.0",
}

# The Thinking variants' recommended sampling (QwenLM/Qwen3-VL README; ../shared/NOTES.md)
THINKING_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}

PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


def _merge(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def preset_config(preset: str, changes: dict | None = None) -> dict:
    """config.json contents for a preset (Qwen3-VL: tiny, tiny-moe, 2b, 4b, 8b, 32b, 30b-a3b;
    Qwen3.5: qwen3.5-tiny, qwen3.5-tiny-moe, qwen3.5-0.8b, -2b, -4b, -9b, -27b, -35b-a3b;
    RETRIEVAL_PRESETS: embedding-tiny ... reranker-8b), with optional nested overrides (a hybrid
    config's layer_types follow a new num_hidden_layers)."""
    if preset in RETRIEVAL_PRESETS:
        return retrieval_config(preset_config(RETRIEVAL_PRESETS[preset][1], changes))
    tiny = _merge(OFFICIAL_2B, TINY_CHANGES)
    tiny35 = _merge(QWEN3_5_2B, QWEN3_5_TINY)
    presets = {"2b": OFFICIAL_2B, "tiny": tiny, "tiny-moe": _merge(tiny, TINY_MOE), "30b-a3b": _merge(OFFICIAL_2B, MOE_30B),
               **{name: _merge(OFFICIAL_2B, size) for name, size in SIZE_CHANGES.items()},
               "qwen3.5-tiny": tiny35, "qwen3.5-tiny-moe": _merge(tiny35, QWEN3_5_TINY_MOE),
               **{name: _merge(QWEN3_5_2B, size) for name, size in QWEN3_5_SIZES.items()}}
    if preset not in presets:
        raise ValueError(f"unknown preset '{preset}' (choose from: {', '.join(presets)})")
    config = _merge(presets[preset], changes or {})
    text = config["text_config"]
    text["tie_word_embeddings"] = config["tie_word_embeddings"]
    if "layer_types" in text and len(text["layer_types"]) != text["num_hidden_layers"]:
        text["layer_types"] = hybrid_layers(text["num_hidden_layers"])
    return config


EMBED_STD = 0.05  # small next to the layers' outputs, so a tied lm_head does not just echo the input


def random_tensors(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Random bf16 weights under checkpoint names, one tensor at a time. Linear weights
    ~ N(0, 1/fan_in) so activations keep their scale and logits are peaked (greedy decoding
    has margins)."""
    with torch.device("meta"):
        model = Qwen3VL(cfg)
    gen = torch.Generator().manual_seed(seed)
    to_checkpoint = {dst: src for src, dst in NAME_PREFIXES}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if cfg.text.zero_centred_norm and name.startswith("language_model.") and name.endswith("norm.weight") \
                and ".linear_attn." not in name:
            t = 0.1 * torch.randn(p.shape, generator=gen)  # the norm scales by 1 + weight
        elif name.endswith(".A_log"):
            t = torch.empty(p.shape).uniform_(0.01, 2, generator=gen).log()  # slow and fast decays: the state matters
        elif name.endswith(".dt_bias"):
            t = torch.ones(p.shape)
        elif name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
            t = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.02 * torch.randn(p.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t = EMBED_STD * torch.randn(p.shape, generator=gen)
        elif name.endswith("pos_embed.weight"):
            t = torch.randn(p.shape, generator=gen)
        else:
            fan_in = p.shape[1] if ".experts." in name else p[0].numel()  # experts: [E, in, out]
            t = torch.randn(p.shape, generator=gen) / fan_in**0.5
        prefix = next(dst for dst in to_checkpoint if name.startswith(dst))
        name = to_checkpoint[prefix] + name[len(prefix) :]
        if cfg.model_type == "qwen3_5_moe" and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            t = t.transpose(1, 2)  # Qwen3.5's published mixtures: [E, 2I, H] and [E, H, I]
        yield name, t.contiguous().to(torch.bfloat16)


# -- a stress checkpoint: trained-model-like outliers --------------------------------------

OUTLIER_CHANNELS = 6  # hidden channels per tower whose norm weights are scaled up
OUTLIER_SCALE = (30.0, 100.0)  # range of the per-channel factors
MASSIVE_TOKENS = (151644, 198, 151652)  # <|im_start|>, "\n", <|vision_start|>
MASSIVE_DIMS = 2
MASSIVE_VALUE = 50.0  # ~100x a residual-stream entry (rms ~0.5)
# each norm feeding linears -> the linears it feeds
TEXT_NORMS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
VISION_NORMS = {"norm1": ("attn.qkv",), "norm2": ("mlp.linear_fc1",)}


def plant_outliers(state: dict[str, torch.Tensor], cfg: ModelConfig, seed: int) -> dict[str, list]:
    """Make random weights look like a trained model's to an int8-activation scheme (in place):
    (a) OUTLIER_CHANNELS hidden channels per tower (fixed for the checkpoint, as trained models'
    outlier features are) get their norm weights (LayerNorm: weight and bias) scaled by 30-100x
    in every norm feeding a linear. The fed linears' input columns stay flat, as trained weights
    are where activations have outliers (SmoothQuant's observation), so the outlier channels
    carry much of each product; their output rows are divided by the growth this causes, so
    products, attention logits and the residual stream keep their scale (a row scale is
    invisible to per-row weight and per-token activation quantisation).
    (b) "massive activations": MASSIVE_DIMS embedding dims of a few frequent/special tokens are
    set to MASSIVE_VALUE, carried by the residual stream through every layer; the final norm
    damps those dims, so the tied lm_head does not favour those tokens.
    Returns what was planted (channels, dims, tokens)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    planted: dict[str, list] = {}
    towers = (("text", "model.language_model.layers", cfg.text.num_hidden_layers, cfg.text.hidden_size, TEXT_NORMS),
              ("vision", "model.visual.blocks", cfg.vision.depth, cfg.vision.hidden_size, VISION_NORMS))
    for tower, prefix, depth, width, norms in towers:
        channels = torch.randperm(width, generator=gen)[:OUTLIER_CHANNELS]
        lo, hi = OUTLIER_SCALE
        factors = lo + (hi - lo) * torch.rand(OUTLIER_CHANNELS, generator=gen)
        growth = ((width - OUTLIER_CHANNELS + factors.pow(2).sum()) / width).sqrt().item()  # rms of a fed product
        planted[f"{tower}_channels"] = channels.tolist()
        for layer, (norm, linears) in itertools.product(range(depth), norms.items()):
            for name in _present(state, f"{prefix}.{layer}.{norm}"):
                t = state[name]
                t[channels] = (t[channels].float() * factors).to(t.dtype)
            for linear in linears:
                for name in _present(state, f"{prefix}.{layer}.{linear}"):
                    state[name] = (state[name].float() / growth).to(state[name].dtype)
    embed = state["model.language_model.embed_tokens.weight"]
    free = torch.tensor([c for c in range(embed.shape[1]) if c not in planted["text_channels"]])
    dims = free[torch.randperm(len(free), generator=gen)[:MASSIVE_DIMS]]
    signs = torch.randint(0, 2, (len(MASSIVE_TOKENS), MASSIVE_DIMS), generator=gen) * 2 - 1
    rows = torch.tensor(MASSIVE_TOKENS)
    embed[rows[:, None], dims[None, :]] = (MASSIVE_VALUE * signs).to(embed.dtype)
    state["model.language_model.norm.weight"][dims] = 0.01
    planted.update(massive_dims=dims.tolist(), massive_tokens=list(MASSIVE_TOKENS))
    return planted


def _present(state: dict[str, torch.Tensor], module: str) -> list[str]:
    return [name for leaf in ("weight", "bias") if (name := f"{module}.{leaf}") in state]


def write_side_files(out: Path, config: dict, thinking: bool = False, generation: dict | None = None,
                     preprocessor: dict | None = None) -> ModelConfig:
    """Everything of a checkpoint folder but its weights: config.json, generation_config.json
    (`generation` overrides the family's defaults), preprocessor_config.json (`preprocessor`
    overrides the published one), the chat template and the tokenizer files."""
    from qvl.processing.tokenizer import write_tokenizer_files

    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hybrid = cfg.model_type in HYBRID_MODEL_TYPES
    if hybrid:  # one template for both: its `enable_thinking` switch (on unless a request turns it off)
        defaults, name = QWEN3_5_GENERATION_CONFIG, "qwen3_5_chat_template.jinja"
    else:
        defaults = {**GENERATION_CONFIG, **THINKING_SAMPLING} if thinking else GENERATION_CONFIG
        name = "qwen3_vl_thinking_chat_template.jinja" if thinking else "qwen3_vl_chat_template.jinja"
    (out / "generation_config.json").write_text(json.dumps({**defaults, **(generation or {})}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(_merge(PREPROCESSOR_CONFIG, preprocessor or {}),
                                                             indent=2))
    template = resources.files("qvl") / "data" / name
    with resources.as_file(template) as path:
        shutil.copyfile(path, out / "chat_template.jinja")
    write_tokenizer_files(out, family="qwen3_5" if hybrid else "qwen3_vl")
    return cfg


def write_checkpoint(out: str | Path, preset: str = "tiny", seed: int = 0, changes: dict | None = None,
                     outliers: bool = False, thinking: bool = False, quant: QuantSpec | None = None,
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a complete checkpoint folder (config, weights, tokenizer, template, preprocessor);
    `outliers` plants trained-model-like outliers (see plant_outliers) and records them in
    the safetensors metadata under "qvl_outliers"; `thinking` gives it a Thinking variant's
    chat template (the answer opens `<think>`) and sampling defaults; `quant` writes the
    pre-quantised checkpoint `qvl quantize` would make of the bf16 one, tensor by tensor
    (a 30B model without its 62 GB bf16 file). Weights are sharded as published ones are."""
    out = Path(out)
    config = preset_config(preset, changes)
    cfg = write_side_files(out, config, thinking=thinking)
    tensors, metadata = random_tensors(cfg, seed), {"format": "pt"}
    if outliers:
        state = dict(tensors)
        metadata["qvl_outliers"] = json.dumps(plant_outliers(state, cfg, seed))
        tensors = iter(state.items())
    if quant is not None:
        tensors, metadata = quantized_tensors(tensors, cfg, quant), {**metadata, **quant.metadata()}
    write_shards(tensors, out, metadata, shard_bytes)
    if preset in RETRIEVAL_PRESETS:
        write_retrieval_files(out, RETRIEVAL_PRESETS[preset][0], cfg)
    return out


# -- Qwen3-VL-Embedding and Qwen3-VL-Reranker ----------------------------------------------
# The base models' layout (the 2B's config.json as published, written by transformers 5), and
# the sentence-transformers files that say what each is (qvl.retrieval.task reads them).

RETRIEVAL_PRESETS = {f"{kind}-{size}": (kind, size) for kind in ("embedding", "reranker")
                     for size in ("tiny", "2b", "8b")}


def retrieval_config(config: dict) -> dict:
    """A base config as the retrieval checkpoints carry it: `rope_parameters` (rope_theta
    inside), transformers 5.1."""
    text = config["text_config"]
    text["rope_parameters"] = {**text.pop("rope_scaling"), "rope_theta": text.pop("rope_theta")}
    return {**config, "transformers_version": "5.1.0"}


def write_retrieval_files(out: Path, kind: str, cfg: ModelConfig) -> None:
    """modules.json, config_sentence_transformers.json, sentence_bert_config.json and the head
    module's config: last-token pooling then normalisation (embedding), or the "yes" - "no"
    logit score (reranker)."""
    from qvl.processing.tokenizer import Tokenizer

    def module(idx: int, path: str, package: str, name: str) -> dict:
        return {"idx": idx, "name": str(idx), "path": path, "type": f"sentence_transformers.{package}.models.{name}"}

    transformer = module(0, "", "base", "Transformer")
    if kind == "embedding":
        modules = [transformer, module(1, "1_Pooling", "sentence_transformer", "Pooling"),
                   module(2, "2_Normalize", "base", "Normalize")]
        heads = {"1_Pooling": {"embedding_dimension": cfg.text.hidden_size, "pooling_mode": "lasttoken",
                               "include_prompt": True}, "2_Normalize": None}
        model_type, task, length = "SentenceTransformer", "feature-extraction", 8192
    else:
        tokenizer = Tokenizer.from_dir(out)
        modules = [transformer, module(1, "1_LogitScore", "cross_encoder", "LogitScore")]
        heads = {"1_LogitScore": {"true_token_id": tokenizer.token_id("yes"),
                                  "false_token_id": tokenizer.token_id("no"), "module_input_name": "causal_logits"}}
        model_type, task, length = "CrossEncoder", "text-generation", 10240
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"model_type": model_type, "prompts": {}, "default_prompt_name": None}, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": task, "max_seq_length": length},
                                                              indent=2))
    for folder, config in heads.items():
        (out / folder).mkdir(exist_ok=True)
        if config is not None:
            (out / folder / "config.json").write_text(json.dumps(config, indent=2))
