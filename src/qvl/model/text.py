"""Qwen3-VL text decoder: RMSNorm, per-head q/k norm, grouped-query attention with a
preallocated KV cache, SwiGLU MLP and DeepStack injection. Pure torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qvl import native
from qvl.dispatch import kernels
from qvl.config import TextConfig
from qvl.kv_cache import BLOCK, KVCache
from qvl.model.rope import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and (k := kernels()).rms_norm(x.dtype):
            return native.rms_norm(k.lib, x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def causal_mask(start: int, length: int) -> torch.Tensor:
    q = torch.arange(start, start + length)[:, None]
    return (torch.arange(start + length)[None, :] <= q)[None, None]


def cache_attention(q: torch.Tensor, cache: KVCache, layer: int, start: int | torch.Tensor) -> torch.Tensor:
    """Causal attention of new queries over the paged cache (GQA), whose rows already hold
    their keys and values. start an int: q [B, H, T, hd] at positions start..start+T of each
    row. start [B] (one query per row, T = 1): row b's query at position start[b] attends to
    its first start[b]+1 positions only, so its result is the same whatever the other rows
    hold. The native kernels read through the block tables where they apply: one query per
    row (decoding), and causal prefill of one row (bf16); elsewhere the rows' keys are gathered
    for torch's SDPA."""
    b, _, t, _ = q.shape
    k, out = kernels(), None
    keys, values = cache.pool.keys[layer], cache.pool.values[layer]
    decoding = isinstance(start, torch.Tensor)  # a prompt's token takes prefill's kernel, even alone
    if decoding and k.decode_attention(q.dtype):
        out = native.decode_attention(k.lib, q, keys, values, cache.table, start + 1)
    elif not decoding and b == 1 and k.flash_attention(q.dtype):
        out = native.paged_attention(k.lib, q[0].transpose(0, 1), keys, values, cache.table[0], start)
        out = None if out is None else out.transpose(0, 1)[None]
    if out is not None:
        return out
    if decoding:  # row by row over its own keys: nothing of another row enters
        return torch.cat([F.scaled_dot_product_attention(q[i : i + 1], *cache.row(i).gather(layer, n + 1),
                                                         enable_gqa=True)
                          for i, n in enumerate(start.tolist())])
    keys, values = cache.gather(layer, start + t)
    mask = causal_mask(start, t) if start > 0 else None  # SDPA's is_causal aligns the diagonal top-left
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefill: bool) -> torch.Tensor:
    """x [B, H, T, hd] rotated by cos/sin [B, 1, T, hd]: one native pass for a prefill row
    (any T, so that a prompt token rounds alike in any slice), else the reference's ops."""
    if prefill and x.shape[0] == 1 and (k := kernels()).fused_elementwise(x.dtype):
        if (out := native.text_rope(k.lib, x, cos, sin)) is not None:
            return out
    return apply_rotary(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

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
        cache.write(self.layer, start, rotary(k, cos, sin, prefill), v)
        if first == t:
            return x[:, t:]
        q = self.q_norm(self.q_proj(x[:, first:]).view(b, t - first, self.heads, self.head_dim)).transpose(1, 2)
        q = rotary(q, cos[:, :, first:], sin[:, :, first:], prefill)
        out = cache_attention(q, cache, self.layer, start + first if first else start)
        return self.o_proj(out.transpose(1, 2).reshape(b, t - first, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype == up.dtype and (k := kernels()).fused_elementwise(gate.dtype):
            return self.down_proj(native.silu_mul(k.lib, gate, up))
        return self.down_proj(F.silu(gate) * up)


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
    once per call, only for the experts some token chose."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)

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
        return out.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start, queries=None):
        # x: [B, T, D] -> [B, T, D], or the last `queries` positions [B, queries, D] (see Attention)
        out = self.self_attn(self.input_layernorm(x), cos, sin, cache, start, queries)
        x = x[:, x.shape[1] - out.shape[1]:] + out
        return x if x.shape[1] == 0 else x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._native_layers = None  # built at the first decode step, after the weights are loaded

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
        if isinstance(start, torch.Tensor) and (k := kernels()).decode_step(h.dtype):
            out = self.decode_native(k.lib, h, cos, sin, cache, start)
            if out is not None:
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
        """Whether a decode step computes each row as it would alone: the one-call native
        step runs (its GEMV kernels take each row's products separately); torch's GEMMs,
        which the per-op path uses for plain float weights, may round differently with the
        row count."""
        if self._native_layers is None:
            self._native_layers = self._layer_args()
        return bool(self._native_layers) and kernels().decode_step(self._native_layers.dtype)

    def decode_native(self, lib, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                      slots: torch.Tensor) -> torch.Tensor | None:
        """A decode step (h: [B, 1, D] bf16 or float32, B <= the GEMV row limit, so that the per-op path
        runs the same kernels) through every layer in one native call: the same kernels and
        roundings without the per-op path's ~8 ms of per-token overhead. None when the
        layers, the cache or the inputs are not what the kernel takes (nothing written)."""
        cfg, b = self.cfg, h.shape[0]
        if self._native_layers is None:
            self._native_layers = self._layer_args()
        if self._native_layers is False or h.dtype != self._native_layers.dtype or b > native.GEMV_MAX_ROWS:
            return None
        pool = cache.pool
        shape = (cfg.num_hidden_layers, pool.blocks, cfg.num_key_value_heads, BLOCK, cfg.head_dim)
        if pool.keys.dtype != h.dtype or tuple(pool.keys.shape) != shape or cos.dtype != h.dtype:
            return None
        if cos.numel() != b * cfg.head_dim or slots.shape != (b,) or cache.table.shape[0] != b:
            return None
        cache.locate(slots, 1)  # "KV cache overflow" past a row's blocks, as the per-op path says it
        return native.decode_layers(lib, self._native_layers, h, cos, sin, cache, slots,
                                    heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                                    intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps)

    def _apply(self, fn, *args, **kwargs):
        self._native_layers = None  # .to() and friends replace the tensors the table points to
        return super()._apply(fn, *args, **kwargs)

    def _moe_args(self, moe: SparseMoE, dtype: torch.dtype) -> native.MoeArgs | None:
        """A mixture's router and experts for native.decode_layers, or None (a float router or
        float experts, or shapes other than the config's: the per-layer path)."""
        cfg, experts = self.cfg, moe.experts
        d, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        router = getattr(moe.gate, "native_args", lambda: None)()
        if router is None or router.dtype != dtype or (router.n, router.k) != (e, d) \
                or not hasattr(experts, "native_args") or not 0 < moe.top_k <= e:
            return None
        pairs = [experts.native_args(i) for i in range(e)]
        if any(a.dtype != dtype for pair in pairs for a in pair):
            return None
        if any(((g.n, g.k), (dn.n, dn.k)) != ((2 * inter, d), (d, inter)) for g, dn in pairs):
            return None
        return native.MoeArgs.of(moe.top_k, inter, router, [g for g, _ in pairs],
                                 [d for _, d in pairs])

    def _layer_args(self):
        """The layers' weights for native.decode_layers, or False (a plain nn.Linear, mixed
        dtypes, shapes other than the config's). Built once: the weights are fixed after
        loading."""
        cfg = self.cfg
        dtype = self.norm.weight.dtype
        d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        shapes = [(q_out, d), (kv_out, d), (kv_out, d), (d, q_out), (inter, d), (inter, d), (d, inter)]
        args, tensors = [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
            if any(n.weight.dtype != dtype for n in norms):
                return False
            if [n.weight.numel() for n in norms] != [d, d, hd, hd]:
                return False
            dense = isinstance(mlp, MLP)
            modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) + (
                (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if dense else ())
            linears = [getattr(m, "native_args", lambda: None)() for m in modules]
            if any(a is None or a.dtype != dtype for a in linears):
                return False
            if [(a.n, a.k) for a in linears] != shapes[:len(linears)]:
                return False
            moe = native.MoeArgs() if dense else self._moe_args(mlp, dtype)
            if moe is None:
                return False
            linears += [native.LinearArgs()] * (7 - len(linears))  # a mixture's layer: no dense MLP
            args.append(native.LayerArgs(*(n.weight.data_ptr() for n in norms), *linears, moe))
            tensors += [n.weight for n in norms] + [t for a in linears for t in getattr(a, "tensors", [])]
            tensors += getattr(moe, "tensors", [])
        array = (native.LayerArgs * len(args))(*args)
        array.tensors = tensors  # keeps every pointed-to tensor alive as long as the array
        array.dtype = dtype
        return array
