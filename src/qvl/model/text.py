"""The text decoder of Qwen3-VL and Qwen3.5/3.6: RMSNorm, per-head q/k norm, grouped-query
attention over the paged KV cache, SwiGLU MLP or a mixture of experts, DeepStack injection
(Qwen3-VL); Qwen3.5's hybrid layers (Gated DeltaNet where `layer_types` says
linear_attention), its attention's output gate and partial rotary, and its norms scaling by
(1 + weight). Torch modules calling qvl.kernels.ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qvl.config import TextConfig
from qvl.kernels import ops
from qvl.kv_cache import KVCache
from qvl.model.gated_deltanet import GatedDeltaNet


class RMSNorm(nn.Module):
    """RMSNorm scaling by `weight`, or by (1 + weight) when `zero_centred` (Qwen3.5)."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.zero_centred = eps, zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centred:
            return ops.rms_norm_zero_centred(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention; `layer` is its index among the layers with keys and values.
    Qwen3.5: q_proj also gives a gate per query dim (the output is multiplied by its sigmoid),
    and only the first rotary_dim dims of each head are rotated."""

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gated, self.rotary_dim = cfg.attn_output_gate, cfg.rotary_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefill: bool) -> torch.Tensor:
        """x [B, H, T, hd] with its first rotary_dim dims rotated by cos/sin [B, 1, T, rotary_dim]."""
        if self.rotary_dim == self.head_dim:
            return ops.text_rope(x, cos, sin, prefill)
        rotated = ops.text_rope(x[..., : self.rotary_dim].contiguous(), cos, sin, prefill)
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int | torch.Tensor,
        queries: int | None = None,
    ) -> torch.Tensor:
        # x: [B, T, D]; cos/sin: [B, 1, T, hd]; start: int, or [B] positions of the cache's rows (T = 1);
        # queries: attend from the last `queries` positions only (prefill; every key and value is
        # still written; 0: nothing else) -> [B, queries, D]; None: all T -> [B, T, D]
        b, t, _ = x.shape
        first = t - (t if queries is None else queries)  # the first position queried, from the slice's start
        prefill = not isinstance(start, torch.Tensor)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cache.write(self.layer, start, self.rope(k, cos, sin, prefill), v)
        if first == t:
            return x[:, t:]
        q = self.q_proj(x[:, first:]).view(b, t - first, self.heads, -1)
        if self.gated:  # per head: the query's dims, then its gate's
            q, gate = q.chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        q = self.rope(q, cos[:, :, first:], sin[:, :, first:], prefill)
        out = ops.cache_attention(q, cache, self.layer, start + first if first else start)
        out = out.transpose(1, 2).reshape(b, t - first, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(b, t - first, -1))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class Experts(nn.Module):
    """E SwiGLU experts, fused as published: gate_up_proj [E, H, 2I] (gate = the first half
    of the last dim), down_proj [E, I, H]."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        # x: [n, H] tokens routed to `expert` -> [n, H]
        gate, up = (x @ self.gate_up_proj[expert]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj[expert]


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Qwen3VLMoe): the router scores the E experts per token, the
    top k by softmax (in float32) run, their outputs summed with the softmax weights
    renormalised over the k. Tokens are grouped by expert: each expert's weights are read
    once per call, only for the experts some token chose. Qwen3.5's mixtures add a shared
    expert that every token runs, weighted by the sigmoid of its own gate."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H]
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float)  # [N, E]
        # the k largest, ties to the lower index (torch.topk leaves ties unspecified; bf16 router
        # logits tie often, and the one-call decode step picks the same experts)
        weights, chosen = (t[:, : self.top_k] for t in probs.sort(dim=-1, descending=True, stable=True))  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        for expert in chosen.unique().tolist():
            tokens, slot = (chosen == expert).nonzero(as_tuple=True)
            out.index_add_(0, tokens, self.experts(flat[tokens], expert) * weights[tokens, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(x.shape)


class DecoderLayer(nn.Module):
    """A token mixer (attention, or a Gated DeltaNet where layer_types says linear_attention)
    and an MLP, each after a norm and added to the residual."""

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        if cfg.is_linear_layer(layer):
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer))
        else:
            self.self_attn = Attention(cfg, cfg.attention_layers.index(layer))
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)

    def forward(self, x, cos, sin, cache, start, queries=None):
        # x: [B, T, D] -> [B, T, D], or the last `queries` positions [B, queries, D] (see Attention)
        if hasattr(self, "linear_attn"):
            out = self.linear_attn(self.input_layernorm(x), cache, start, queries)
        else:
            out = self.self_attn(self.input_layernorm(x), cos, sin, cache, start, queries)
        x = x[:, x.shape[1] - out.shape[1]:] + out
        return x if x.shape[1] == 0 else x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.step_args = None  # the one-call decode step's view of the weights (qvl.kernels.decode_step)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        start: int | torch.Tensor,
        visual_mask: torch.Tensor | None = None,
        deepstack: list[torch.Tensor] | None = None,
        last: int | None = None,
    ) -> torch.Tensor:
        """h: [B, T, D] embeddings written at positions start..start+T of the cache's B rows
        (start an int), or one token per row (T = 1) at position start[b] of row b ([B] long:
        rows of different lengths); cos/sin: [B, 1, T, hd]; visual_mask: [B, T] image positions
        receiving deepstack[i] ([n_visual, D]) after layer i. Returns final-normed hidden
        states [B, T, D], or with `last` (prefill) those of the last `last` positions
        [B, last, D]: the final layer then runs its queries, output projection and MLP for
        those positions only (every position's keys and values are still written; a row's
        result does not change, the kernels computing each row alike whatever the others);
        last = 0 (a slice inside a prompt, whose logits nobody reads): [B, 0, D].
        The caller owns the rows' lengths: nothing here counts them."""
        if isinstance(start, torch.Tensor) and (out := ops.decode_layers(self, h, cos, sin, cache, start)) is not None:
            return self.norm(out)
        final = len(self.layers) - 1
        # features added after the final layer (a checkpoint this shallow only in tests): it runs
        # every position, and the last ones are taken after
        queries = None if deepstack is not None and len(deepstack) > final else last
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, start, queries if i == final else None)
            if deepstack is not None and i < len(deepstack):
                h = h.index_put((visual_mask,), deepstack[i].to(h.dtype), accumulate=True)
        if last is not None:
            h = h[:, h.shape[1] - last :]
        return self.norm(h) if h.shape[1] else h

    def rows_independent(self) -> bool:
        """Whether a decode step computes each row as it would alone (whatever the other rows)."""
        return ops.rows_independent(self)

    def _apply(self, fn, *args, **kwargs):
        self.step_args = None  # .to() and friends replace the tensors the decode step points to
        return super()._apply(fn, *args, **kwargs)
