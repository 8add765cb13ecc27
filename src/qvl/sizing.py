"""What a model needs, before loading it: the bytes of its weights in each format, the KV cache
per token, and the decode speed this machine's memory bandwidth allows (`qvl info --model`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from qvl.config import ModelConfig

FORMATS = ("bf16", "int8", "int4")
GROUP_SIZE = 128


@dataclass(frozen=True)
class Footprint:
    weights: str
    total_bytes: int  # every tensor as qvl keeps it in memory
    read_per_token: int  # what one decode step reads: the text decoder's linears and the lm_head (and the
    # chosen experts: top-k of each layer's)
    kv_per_token: int  # keys and values of one position, all layers (bf16)

    def to_dict(self) -> dict:
        return {"weights": self.weights, "total_gb": round(self.total_bytes / 1e9, 2),
                "decode_read_gb": round(self.read_per_token / 1e9, 2),
                "kv_mb_per_1k_tokens": round(self.kv_per_token * 1000 / 1e6, 1)}


def linear_bytes(linear: nn.Linear, weights: str) -> int:
    """One linear as qvl stores it: int8 with a scale per output row, int4 with a scale and a
    zero per group of GROUP_SIZE inputs (both in bf16; int8 where the groups do not divide its
    inputs, as qvl.quantize does), or bf16."""
    out, inp = linear.weight.shape
    bias = 2 * out if linear.bias is not None else 0
    if weights == "int8" or (weights == "int4" and inp % GROUP_SIZE):
        return out * inp + 2 * out + bias
    if weights == "int4":
        return out * inp // 2 + 2 * 2 * out * (inp // GROUP_SIZE) + bias
    return 2 * out * inp + bias


def footprint(cfg: ModelConfig, weights: str, vision_int8: bool = False) -> Footprint:
    """The text decoder's linears and the lm_head in `weights` (the vision tower's too, int8,
    with vision_int8), everything else bf16; a tied lm_head shares the embedding's bytes."""
    from qvl.model.qwen3_vl import Qwen3VL

    with torch.device("meta"):
        model = Qwen3VL(cfg)
    total = read = 0
    linears = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        text = name.startswith("language_model.") or name == "lm_head"
        fmt = weights if text else ("int8" if vision_int8 and weights != "bf16" else "bf16")
        size = linear_bytes(module, fmt)
        total += size
        read += size if text else 0
        linears.update(id(p) for p in module.parameters())
    t = cfg.text
    for name, param in model.named_parameters():
        if id(param) in linears:
            continue
        if ".experts." in name:  # every expert is held (in `weights`), a decode step reads the k chosen
            e, inp, out = param.shape  # published [E, in, out]
            if weights == "bf16":
                size = 2 * param.numel()
            elif weights == "int4" and t.hidden_size % GROUP_SIZE == 0 and t.moe_intermediate_size % GROUP_SIZE == 0:
                size = param.numel() // 2 + 2 * 2 * e * out * (inp // GROUP_SIZE)
            else:  # int8 (int4 falls back to it where the group does not divide the sizes)
                size = param.numel() + 2 * e * out
            total += size
            read += size * t.num_experts_per_tok // t.num_experts
            continue
        if name.endswith("embed_tokens.weight") and cfg.tie_word_embeddings and weights != "bf16":
            continue  # the quantised lm_head is the embedding
        total += 2 * param.numel()
    if cfg.tie_word_embeddings and weights == "bf16":
        total -= 2 * t.vocab_size * t.hidden_size  # one tensor for both
    kv = 2 * len(t.attention_layers) * t.num_key_value_heads * t.head_dim * 2
    return Footprint(weights, total, read, kv)


def read_bandwidth(gigabytes: float = 1.0, repeats: int = 3) -> float:
    """Bytes per second this machine reads (the best of a few sums over a large tensor; a
    floor: the decode kernels read faster than torch's sum)."""
    x = torch.ones(int(gigabytes * 1e9) // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return x.numel() * 4 / best
