"""Qwen3-VL text decoder: RMSNorm, per-head q/k norm, grouped-query attention with a
preallocated KV cache, SwiGLU MLP and DeepStack injection. Pure torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qvl import native
from qvl.dispatch import kernels
from qvl.config import TextConfig
from qvl.kv_cache import KVCache
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


def attention_mask(start: int, length: int, key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, start+T] (True = attend) for T new queries at positions
    start..start+T over all keys so far, hiding the key_mask's padding slots ([B, S] False);
    None without a key_mask: plain causal attention, which cache_attention applies itself."""
    if key_mask is None:
        return None
    return causal_mask(start, length) & key_mask[:, None, None, : start + length]


def causal_mask(start: int, length: int) -> torch.Tensor:
    q = torch.arange(start, start + length)[:, None]
    return (torch.arange(start + length)[None, :] <= q)[None, None]


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """q: [B, H, T, hd] at positions start..start+T over the cache's keys/values
    [B, H_kv, start+T, hd] (GQA); mask from attention_mask (None = causal). The native
    kernels run where they apply: one query (decoding) over the cache, and causal prefill of
    one row (bf16); torch's SDPA spends ~3.5 ms per layer on one query at 2k positions."""
    b, _, t, _ = q.shape
    k, out = kernels(), None
    if t == 1 and k.decode_attention(q.dtype):
        out = native.decode_attention(k.lib, q, keys, values, None if mask is None else mask[:, 0, 0])
    elif b == 1 and mask is None and k.flash_attention(q.dtype):
        out = native.attention(k.lib, q[0].transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1),
                               start)
        out = None if out is None else out.transpose(0, 1)[None]
    if out is not None:
        return out
    if mask is None and t > 1 and start > 0:  # SDPA's is_causal aligns the diagonal top-left
        mask = causal_mask(start, t)
    causal = mask is None and t > 1
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)


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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # x: [B, T, D]; cos/sin: [B, 1, T, hd]
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values = cache.update(self.layer, start, k, v)
        out = cache_attention(q, keys, values, start, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        start: int,
        key_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        deepstack: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """h: [B, T, D] embeddings of positions start..start+T; cos/sin: [B, 1, T, hd];
        visual_mask: [B, T] image positions receiving deepstack[i] ([n_visual, D]) after
        layer i. Returns final-normed hidden states [B, T, D]."""
        out = None
        if h.shape[1] == 1 and deepstack is None and (k := kernels()).decode_step(h.dtype):
            out = self.decode_native(k.lib, h, cos, sin, cache, start, key_mask)
        if out is not None:
            cache.length = start + 1
            return self.norm(out)
        mask = attention_mask(start, h.shape[1], key_mask)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, start, mask)
            if deepstack is not None and i < len(deepstack):
                h = h.index_put((visual_mask,), deepstack[i].to(h.dtype), accumulate=True)
        cache.length = start + h.shape[1]
        return self.norm(h)

    def decode_native(self, lib, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
                      key_mask: torch.Tensor | None) -> torch.Tensor | None:
        """A decode step (h: [B, 1, D] bf16 or float32, B <= the GEMV row limit, so that the per-op path
        runs the same kernels) through every layer in one native call: the same kernels and
        roundings without the per-op path's ~8 ms of per-token overhead. None when the
        layers, the cache or the inputs are not what the kernel takes (nothing written)."""
        cfg, (b, _, d) = self.cfg, h.shape
        if self._native_layers is None:
            self._native_layers = self._layer_args()
        if self._native_layers is False or h.dtype != self._native_layers.dtype or b > native.GEMV_MAX_ROWS:
            return None
        shape = (cfg.num_hidden_layers, b, cfg.num_key_value_heads, cache.capacity, cfg.head_dim)
        if cache.keys.dtype != h.dtype or tuple(cache.keys.shape) != shape or cos.dtype != h.dtype:
            return None
        if cos.numel() != b * cfg.head_dim or (key_mask is not None and key_mask.shape != (b, cache.capacity)):
            return None
        cache.check_room(start + 1)  # the kernel writes position `start` unchecked
        return native.decode_layers(lib, self._native_layers, h, cos, sin, cache.keys, cache.values, start, key_mask,
                                    heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                                    intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps)

    def _apply(self, fn, *args, **kwargs):
        self._native_layers = None  # .to() and friends replace the tensors the table points to
        return super()._apply(fn, *args, **kwargs)

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
            linears = [getattr(m, "native_args", lambda: None)() for m in
                       (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
            if any(a is None or a.dtype != dtype for a in linears) or [(a.n, a.k) for a in linears] != shapes:
                return False
            args.append(native.LayerArgs(*(n.weight.data_ptr() for n in norms), *linears))
            tensors += [n.weight for n in norms] + [t for a in linears for t in a.tensors]
        array = (native.LayerArgs * len(args))(*args)
        array.tensors = tensors  # keeps every pointed-to tensor alive as long as the array
        array.dtype = dtype
        return array
