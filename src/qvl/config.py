"""Frozen configuration dataclasses read from a checkpoint's `config.json` and
`generation_config.json` (Hugging Face layout).

Fields that define the architecture are required: a missing one is an error naming
it, never a silent default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # Gated DeltaNet + gated attention layers
LAYER_KINDS = ("full_attention", "linear_attention")
DEFAULT_MAX_NEW_TOKENS = 1024  # a full page of OCR; used when generation_config sets none


class ConfigError(ValueError):
    """A config file that qvl cannot run: unsupported model or a missing field."""


def _require(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where} is missing the required field '{key}'")
    return d[key]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    max_position_embeddings: int
    attention_bias: bool
    # mixture of experts (Qwen3VLMoe); num_experts 0: every layer is a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen3.5 mixtures: a shared expert beside the routed ones
    # Qwen3.5 / 3.6 (hybrid): the kind of each layer, the Gated DeltaNet's sizes, the gated
    # attention's partial rotary and output gate, and norms scaling by (1 + weight)
    layer_types: tuple[str, ...] = ()  # () : every layer full attention (Qwen3-VL)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    zero_centred_norm: bool = False

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each query/key head that are rotated."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a Gated DeltaNet (linear attention) layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The decoder layers with full attention (the ones that keep keys and values)."""
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_linear_layer(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers (the ones that keep a recurrent state per sequence)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_linear_layer(i))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet's causal convolution: q, k and v."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def state_bytes(self, dtype_bytes: int = 2) -> int:
        """One sequence's recurrent state, all linear layers: the float32 delta-rule states
        and the convolutions' last inputs (in the model dtype)."""
        per_layer = (4 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
                     + dtype_bytes * self.conv_dim * (self.linear_conv_kernel_dim - 1))
        return per_layer * len(self.linear_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts instead of a dense MLP (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict, hybrid: bool = False) -> TextConfig:
        """`hybrid`: a Qwen3.5/3.6 config (layer kinds, Gated DeltaNet sizes, gated attention)."""
        where = "config.json text_config"
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (expected 'silu')")
        # transformers 5 writes `rope_parameters`; the published checkpoints carry the
        # older `rope_scaling` + `rope_theta`. Both describe the same thing.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{where} is missing the required field 'rope_theta'")
        section = rope.get("mrope_section")
        if section is None:
            raise ConfigError(f"{where} is missing the required field 'mrope_section'")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported")
        heads = _require(d, "num_attention_heads", where)
        hidden = _require(d, "hidden_size", where)
        return cls(
            vocab_size=_require(d, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_require(d, "intermediate_size", where),
            num_hidden_layers=_require(d, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=_require(d, "rms_norm_eps", where),
            rope_theta=float(theta),
            mrope_section=tuple(section),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            max_position_embeddings=_require(d, "max_position_embeddings", where),
            attention_bias=bool(d.get("attention_bias", False)),
            **_experts(d, where),
            **(_hybrid(d, rope, where) if hybrid else {}),
        )


def _hybrid(d: dict, rope: dict, where: str) -> dict:
    """The Qwen3.5/3.6 fields of a text config, checked against each other."""
    layers = d.get("num_hidden_layers")
    kinds = d.get("layer_types")
    if kinds is None:
        raise ConfigError(f"{where} is missing the required field 'layer_types' (the kind of each layer: "
                          f"{' or '.join(LAYER_KINDS)})")
    if len(kinds) != layers:
        raise ConfigError(f"{where}: layer_types lists {len(kinds)} layers, num_hidden_layers is {layers}")
    if unknown := sorted(set(kinds) - set(LAYER_KINDS)):
        raise ConfigError(f"{where}: unknown layer kind {unknown[0]!r} in layer_types (expected "
                          f"{' or '.join(LAYER_KINDS)})")
    out = {"layer_types": tuple(kinds), "attn_output_gate": True, "zero_centred_norm": True,
           "partial_rotary_factor": float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))}
    if "linear_attention" in kinds:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim"):
            out[key] = _require(d, key, where)
            if not isinstance(out[key], int) or out[key] < 1:
                raise ConfigError(f"{where}: {key} must be a positive integer, not {out[key]!r}")
        if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
            raise ConfigError(f"{where}: linear_num_value_heads ({out['linear_num_value_heads']}) must be a "
                              f"multiple of linear_num_key_heads ({out['linear_num_key_heads']})")
    if _expert_count(d):
        out["shared_expert_intermediate_size"] = _require(d, "shared_expert_intermediate_size", where)
    return out


def _expert_count(d: dict) -> int:
    """Experts per layer: `num_experts`, or `num_local_experts` as newer transformers saves it."""
    return d.get("num_experts") or d.get("num_local_experts") or 0


def _experts(d: dict, where: str) -> dict:
    """The mixture-of-experts fields of a text config (none for a dense model)."""
    experts = _expert_count(d)
    if not experts:
        return {}
    top_k = _require(d, "num_experts_per_tok", where)
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: num_experts_per_tok {top_k} must be in 1..num_experts ({experts})")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _require(d, "moe_intermediate_size", where),
            "decoder_sparse_step": d.get("decoder_sparse_step") or 1,
            "mlp_only_layers": tuple(d.get("mlp_only_layers") or ())}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def resize_factor(self) -> int:
        """Image sides are multiples of this (32 for Qwen3-VL)."""
        return self.patch_size * self.spatial_merge_size

    @classmethod
    def from_dict(cls, d: dict, deepstack: bool = True) -> VisionConfig:
        """`deepstack`: the config names the layers feeding the decoder (Qwen3-VL); Qwen3.5's
        tower has none."""
        where = "config.json vision_config"
        act = d.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported")
        rope = d.get("rope_parameters") or {}
        return cls(
            depth=_require(d, "depth", where),
            hidden_size=_require(d, "hidden_size", where),
            intermediate_size=_require(d, "intermediate_size", where),
            num_heads=_require(d, "num_heads", where),
            in_channels=d.get("in_channels", 3),
            patch_size=_require(d, "patch_size", where),
            temporal_patch_size=_require(d, "temporal_patch_size", where),
            spatial_merge_size=_require(d, "spatial_merge_size", where),
            out_hidden_size=_require(d, "out_hidden_size", where),
            num_position_embeddings=_require(d, "num_position_embeddings", where),
            deepstack_visual_indexes=tuple(_require(d, "deepstack_visual_indexes", where)) if deepstack else (),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: TextConfig
    vision: VisionConfig
    tie_word_embeddings: bool
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type '{model_type}' is not supported: qvl runs the Qwen3-VL and Qwen3.5/3.6 models "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        text = _require(d, "text_config", "config.json")
        tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        if tie is None:
            raise ConfigError("config.json is missing the required field 'tie_word_embeddings'")
        hybrid = model_type in HYBRID_MODEL_TYPES
        return cls(
            model_type=model_type,
            text=TextConfig.from_dict(text, hybrid),
            vision=VisionConfig.from_dict(_require(d, "vision_config", "config.json"), deepstack=not hybrid),
            tie_word_embeddings=bool(tie),
            image_token_id=_require(d, "image_token_id", "config.json"),
            video_token_id=_require(d, "video_token_id", "config.json"),
            vision_start_token_id=_require(d, "vision_start_token_id", "config.json"),
            vision_end_token_id=_require(d, "vision_end_token_id", "config.json"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def hybrid(self) -> bool:
        """Qwen3.5/3.6: Gated DeltaNet layers keep a recurrent state per sequence."""
        return bool(self.text.linear_layers)

    def is_vision_token(self, ids: torch.Tensor) -> torch.Tensor:
        """Where the vision tower's features go: image and video placeholder tokens (bool, as ids)."""
        return (ids == self.image_token_id) | (ids == self.video_token_id)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults published with the checkpoint (`generation_config.json`)."""

    eos_token_ids: tuple[int, ...]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS

    @classmethod
    def from_dict(cls, d: dict) -> GenerationDefaults:
        eos = d.get("eos_token_id")
        if eos is None:
            raise ConfigError("generation_config.json is missing 'eos_token_id'")
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        greedy = d.get("do_sample") is False
        return cls(
            eos_token_ids=eos_ids,
            temperature=0.0 if greedy else float(d.get("temperature", 1.0)),
            top_k=int(d.get("top_k") or 0),
            top_p=float(d.get("top_p", 1.0)),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            max_new_tokens=int(d.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> GenerationDefaults:
        return cls.from_dict(json.loads(Path(path).read_text()))
