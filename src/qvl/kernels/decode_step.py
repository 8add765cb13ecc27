"""The one-call decode step: every decoder layer of a decode step in one native call, and the
ctypes structures (QvlLinear, QvlMoe, QvlLayer in common.h) it reads, built from the model's
modules once per model."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from qvl.kernels.attention import check_table
from qvl.kernels.build import DTYPES, W_BF16, W_INT4, W_INT8, address
from qvl.kernels.library import library
from qvl.kernels.plan import GEMV_MAX_ROWS, LinearPlan, default_plan
from qvl.kv_cache import BLOCK, KVCache


class LinearArgs(ctypes.Structure):
    """One linear layer as the decode-step kernel reads it (QvlLinear in common.h)."""

    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]

    @classmethod
    def of(cls, kind: int, out_features: int, in_features: int, weight: torch.Tensor, scale=None, zero=None,
           group_size: int = 0, bias=None) -> LinearArgs:
        args = cls(kind, out_features, in_features, group_size, weight.data_ptr(), address(scale), address(zero),
                   address(bias))
        args.tensors = [t for t in (weight, scale, zero, bias) if t is not None]  # the pointers stay valid
        args.dtype = weight.dtype if kind == W_BF16 else scale.dtype  # the compute dtype it expects
        return args


class MoeArgs(ctypes.Structure):
    """A mixture-of-experts MLP as the decode-step kernel reads it (QvlMoe in common.h): the
    router, and arrays of the experts' gate_up and down linears; experts 0 in a dense layer."""

    _fields_ = [("experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("router", LinearArgs), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p)]

    @classmethod
    def of(cls, top_k: int, inter: int, router: LinearArgs, gate_up: list[LinearArgs],
           down: list[LinearArgs]) -> MoeArgs:
        arrays = [(LinearArgs * len(gate_up))(*gate_up), (LinearArgs * len(down))(*down)]
        args = cls(len(gate_up), top_k, inter, router, ctypes.addressof(arrays[0]), ctypes.addressof(arrays[1]))
        args.tensors = [arrays] + router.tensors + [t for a in gate_up + down for t in a.tensors]
        return args


class LayerArgs(ctypes.Structure):
    """One decoder layer's weights (QvlLayer in common.h)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)] + [(name, LinearArgs) for name in
                                                ("q", "k", "v", "o", "gate", "up", "down")] + [("moe", MoeArgs)]


def decode_layers(lib: ctypes.CDLL, layers: ctypes.Array, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: KVCache, slots: torch.Tensor, *, heads: int, head_dim: int, intermediate: int,
                  eps: float) -> torch.Tensor | None:
    """One decode step through every decoder layer in a single call (docs/decisions/decode-step.md).
    h: [B, 1, D] bf16 or float32, and cos/sin [B, 1, 1, hd], the cache's pool [L, blocks, Hkv,
    BLOCK, hd] and the layers' float tensors of the same dtype; batch row b (block table row b of
    `cache`) is written at position slots[b] ([B] int64) and attends to its positions
    0..slots[b]; IndexError when its block table does not hold them. Returns the new hidden
    states [B, 1, D], or None when the kernel does not apply (nothing written)."""
    b, _, d = h.shape
    keys, values = cache.pool.keys, cache.pool.values
    if not keys.is_contiguous() or keys.stride() != values.stride():
        return None
    table, slots = cache.table.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    check_table(table, slots + 1, keys.shape[3], keys.shape[1], "decode step")
    x = h.clone(memory_format=torch.contiguous_format)
    cos, sin = cos.reshape(b, head_dim).contiguous(), sin.reshape(b, head_dim).contiguous()
    status = lib.qvl_decode_layers(
        ctypes.byref(layers), len(layers), x.data_ptr(), DTYPES[h.dtype], b, d, heads, keys.shape[2], head_dim,
        intermediate, eps, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
        table.data_ptr(), table.shape[1], keys.shape[3], keys.stride(1), keys.stride(2), slots.data_ptr(),
        torch.get_num_threads())
    if status == -1:
        raise MemoryError("qvl_decode_layers could not allocate its buffers")
    return x if status == 0 else None



def run(model: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        slots: torch.Tensor) -> torch.Tensor | None:
    """A decode step of `model` (qvl.model.text.TextModel; h: [B, 1, D] bf16 or float32, B up to
    GEMV_MAX_ROWS, so that the per-layer path runs the same kernels) through every layer in one
    native call: the same kernels and roundings without the per-layer path's Python overhead.
    None when the layers, the cache or the inputs are not what the kernel takes (nothing written)."""
    cfg, b = model.cfg, h.shape[0]
    if model.step_args is None:
        model.step_args = layer_args(model)
    layers = model.step_args
    if layers is False or h.dtype != layers.dtype or b > GEMV_MAX_ROWS:
        return None
    pool = cache.pool
    shape = (len(cfg.attention_layers), pool.blocks, cfg.num_key_value_heads, BLOCK, cfg.head_dim)
    if pool.keys.dtype != h.dtype or tuple(pool.keys.shape) != shape or cos.dtype != h.dtype:
        return None
    if cos.numel() != b * cfg.head_dim or slots.shape != (b,) or cache.table.shape[0] != b:
        return None
    cache.locate(slots, 1)  # "KV cache overflow" past a row's blocks, as the per-layer path says it
    return decode_layers(library().lib, layers, h, cos, sin, cache, slots, heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps)


def rows_independent(model: nn.Module) -> bool:
    """Whether a decode step of `model` computes each row as it would alone: the one-call step
    runs (its GEMV kernels take each row's products separately); torch's GEMMs, which the
    per-layer path uses for plain float weights, may round differently with the row count."""
    if model.step_args is None:
        model.step_args = layer_args(model)
    return bool(model.step_args) and default_plan(model.step_args.dtype).decode_step == "qvl_decode_layers"


def linear_args(m: nn.Module) -> LinearArgs | None:
    """A linear layer as the decode step reads it, or None where its decode products are not the
    GEMV (a plain nn.Linear, float32 weights, torch's kernels)."""
    plan = getattr(m, "plan", None)
    if not isinstance(plan, LinearPlan) or plan.decode.name != "gemv":
        return None
    if m.weight.dtype == torch.int8:
        return LinearArgs.of(W_INT8, m.out_features, m.in_features, m.weight, m.scales, bias=m.bias)
    if m.weight.dtype == torch.uint8:
        return LinearArgs.of(W_INT4, m.out_features, m.in_features, m.weight, m.scales, m.zeros, m.group_size)
    return LinearArgs.of(W_BF16, m.out_features, m.in_features, m.weight, bias=m.bias)


def expert_args(experts: nn.Module, e: int) -> tuple[LinearArgs, LinearArgs] | None:
    """Expert e's gate_up and down linears (qvl.quantize's Int8Experts / Int4Experts), or None."""
    plan = getattr(experts, "plan", None)
    if plan is None or any(p.decode.name != "gemv" for p in plan):
        return None

    def matrix(leaf: str) -> LinearArgs:
        w, s = getattr(experts, leaf), getattr(experts, f"{leaf}_scales")
        if w.dtype == torch.int8:
            return LinearArgs.of(W_INT8, w.shape[1], w.shape[2], w[e], s[e])
        return LinearArgs.of(W_INT4, w.shape[1], 2 * w.shape[2], w[e], s[e], getattr(experts, f"{leaf}_zeros")[e],
                             experts.group_size)

    return matrix("gate_up_proj"), matrix("down_proj")


def moe_args(model: nn.Module, moe: nn.Module, dtype: torch.dtype) -> MoeArgs | None:
    """A mixture's router and experts for decode_layers, or None (a float router or float
    experts, or shapes other than the config's: the per-layer path)."""
    cfg = model.cfg
    d, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    router = linear_args(moe.gate)
    if router is None or router.dtype != dtype or (router.n, router.k) != (e, d) or not 0 < moe.top_k <= e:
        return None
    pairs = [expert_args(moe.experts, i) for i in range(e)]
    if any(p is None or p[0].dtype != dtype or p[1].dtype != dtype for p in pairs):
        return None
    if any(((g.n, g.k), (dn.n, dn.k)) != ((2 * inter, d), (d, inter)) for g, dn in pairs):
        return None
    return MoeArgs.of(moe.top_k, inter, router, [g for g, _ in pairs], [dn for _, dn in pairs])


def layer_args(model: nn.Module) -> ctypes.Array | bool:
    """The layers' weights for decode_layers, or False (a layer whose decode products are not the
    GEMV, mixed dtypes, shapes other than the config's). Built once: the weights are fixed after
    loading."""
    cfg, dtype = model.cfg, model.norm.weight.dtype
    if cfg.layer_types:  # Qwen3.5's layers (Gated DeltaNet, gated attention) are not in the kernel
        return False
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = [(q_out, d), (kv_out, d), (kv_out, d), (d, q_out), (inter, d), (inter, d), (d, inter)]
    args, tensors = [], []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        if any(n.weight.dtype != dtype for n in norms) or [n.weight.numel() for n in norms] != [d, d, hd, hd]:
            return False
        dense = hasattr(mlp, "gate_proj")  # else a mixture of experts
        modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) + (
            (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if dense else ())
        linears = [linear_args(m) for m in modules]
        if any(a is None or a.dtype != dtype for a in linears) or [(a.n, a.k) for a in linears] != shapes[:len(linears)]:
            return False
        moe = MoeArgs() if dense else moe_args(model, mlp, dtype)
        if moe is None:
            return False
        linears += [LinearArgs()] * (7 - len(linears))  # a mixture's layer: no dense MLP
        args.append(LayerArgs(*(n.weight.data_ptr() for n in norms), *linears, moe))
        tensors += [n.weight for n in norms] + [t for a in linears for t in getattr(a, "tensors", [])]
        tensors += getattr(moe, "tensors", [])
    array = (LayerArgs * len(args))(*args)
    array.tensors = tensors  # keeps every pointed-to tensor alive as long as the array
    array.dtype = dtype
    return array
