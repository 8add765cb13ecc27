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
from qvl.threads import kernel_threads


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
    router, arrays of the experts' gate_up and down linears, and a shared expert's score
    (Qwen3.5; the shared expert itself is the layer's gate/up/down); experts 0 in a dense layer."""

    _fields_ = [("experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("router", LinearArgs), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("shared_gate", LinearArgs)]

    @classmethod
    def of(cls, top_k: int, inter: int, router: LinearArgs, gate_up: list[LinearArgs], down: list[LinearArgs],
           shared_gate: LinearArgs) -> MoeArgs:
        arrays = [(LinearArgs * len(gate_up))(*gate_up), (LinearArgs * len(down))(*down)]
        args = cls(len(gate_up), top_k, inter, router, ctypes.addressof(arrays[0]), ctypes.addressof(arrays[1]),
                   shared_gate)
        args.tensors = [arrays] + [t for a in [router, shared_gate] + gate_up + down for t in getattr(a, "tensors", [])]
        return args


class DeltaArgs(ctypes.Structure):
    """A Gated DeltaNet layer's weights (QvlDelta in common.h); all zero in an attention layer."""

    _fields_ = [(name, LinearArgs) for name in ("qkv", "z", "b", "a", "out")] + [
        (name, ctypes.c_void_p) for name in ("conv", "dt_bias", "a_log", "norm")]


class LayerArgs(ctypes.Structure):
    """One decoder layer's weights (QvlLayer in common.h)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)] + [(name, LinearArgs) for name in
                                                ("q", "k", "v", "o", "gate", "up", "down")] + [
        ("moe", MoeArgs), ("delta", DeltaArgs)]


class ShapeArgs(ctypes.Structure):
    """The model's shapes (QvlShape in common.h)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("D", "H", "Hkv", "hd", "rotary_dim", "gated", "zero_centred",
                                                    "Hk", "Hv", "Dk", "Dv", "K")] + [("eps", ctypes.c_float)]

    @classmethod
    def of(cls, cfg) -> ShapeArgs:
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
                   cfg.attn_output_gate, cfg.zero_centred_norm, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                   cfg.linear_conv_kernel_dim if cfg.linear_layers else 0, cfg.rms_norm_eps)


class StatesArgs(ctypes.Structure):
    """The rows' Gated DeltaNet states (QvlStates in common.h)."""

    _fields_ = [("conv", ctypes.c_void_p), ("recurrent", ctypes.c_void_p), ("slots", ctypes.c_int64),
                ("rows", ctypes.c_void_p)]


def decode_layers(lib: ctypes.CDLL, layers: ctypes.Array, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: KVCache, slots: torch.Tensor) -> torch.Tensor | None:
    """One decode step through every decoder layer in a single call (docs/decisions/decode-step.md).
    h: [B, 1, D] bf16 or float32, and cos/sin [B, 1, 1, rotary_dim], the cache's pool [L, blocks,
    Hkv, BLOCK, hd] and the layers' float tensors of the same dtype; batch row b (block table row b
    of `cache`) is written at position slots[b] ([B] int64) and attends to its positions
    0..slots[b]; IndexError when its block table does not hold them. A hybrid model's rows move
    their states (cache.states, contiguous) past the token. Returns the new hidden states
    [B, 1, D], or None when the kernel does not apply (nothing written)."""
    b, _, d = h.shape
    keys, values = cache.pool.keys, cache.pool.values
    if not keys.is_contiguous() or keys.stride() != values.stride():
        return None
    table, slots = cache.table.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    check_table(table, slots + 1, keys.shape[3], keys.shape[1], "decode step")
    states, rows = StatesArgs(), None
    if cache.states is not None:
        pool, rows = cache.states.pool, cache.states.slots.to(torch.int64).contiguous()
        states = StatesArgs(pool.conv.data_ptr(), pool.recurrent.data_ptr(), pool.slots, rows.data_ptr())
    x = h.clone(memory_format=torch.contiguous_format)
    cos, sin = cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous()
    status = lib.qvl_decode_layers(
        ctypes.byref(layers), len(layers), ctypes.byref(layers.shape), x.data_ptr(), DTYPES[h.dtype], b,
        cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), table.data_ptr(),
        table.shape[1], keys.shape[3], keys.stride(1), keys.stride(2), slots.data_ptr(), ctypes.byref(states),
        kernel_threads())
    if status == -1:
        raise MemoryError("qvl_decode_layers could not allocate its buffers")
    return x if status == 0 else None


def states_fit(cfg, cache: KVCache, b: int, dtype: torch.dtype) -> bool:
    """Whether the cache holds a Gated DeltaNet state for each of the b rows as the kernel reads
    them (contiguous pools, slots inside them), or the model has no such layers."""
    if not cfg.linear_layers:
        return True
    states = cache.states
    if states is None or states.slots.shape != (b,):
        return False
    pool = states.pool
    return (pool.conv.is_contiguous() and pool.recurrent.is_contiguous() and pool.conv.dtype == dtype
            and pool.recurrent.dtype == torch.float32 and pool.conv.shape[0] == len(cfg.linear_layers)
            and 0 <= int(states.slots.min()) and int(states.slots.max()) < pool.slots)


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
    if cos.numel() != b * cfg.rotary_dim or slots.shape != (b,) or cache.table.shape[0] != b:
        return None
    if not states_fit(cfg, cache, b, h.dtype):
        return None
    cache.locate(slots, 1)  # "KV cache overflow" past a row's blocks, as the per-layer path says it
    return decode_layers(library().lib, layers, h, cos, sin, cache, slots)


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
    """A mixture's router, experts and shared expert's score for decode_layers, or None (a float
    router or float experts, or shapes other than the config's: the per-layer path)."""
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
    shared = LinearArgs()
    if hasattr(moe, "shared_expert"):
        shared = linear_args(moe.shared_expert_gate)
        if shared is None or shared.dtype != dtype or (shared.n, shared.k) != (1, d):
            return None
    return MoeArgs.of(moe.top_k, inter, router, [g for g, _ in pairs], [dn for _, dn in pairs], shared)


def checked(modules: tuple[nn.Module, ...], shapes: list[tuple[int, int]], dtype: torch.dtype) -> list[LinearArgs] | None:
    """The modules' LinearArgs when each is a GEMV linear of `dtype` with its (out, in) shape."""
    linears = [linear_args(m) for m in modules]
    if any(a is None or a.dtype != dtype for a in linears) or [(a.n, a.k) for a in linears] != shapes:
        return None
    return linears


def float_tensors(tensors: list[torch.Tensor], sizes: list[int], dtype: torch.dtype) -> bool:
    return all(t.dtype == dtype and t.is_contiguous() and t.numel() == n for t, n in zip(tensors, sizes))


def mixer_args(cfg, layer: nn.Module, dtype: torch.dtype) -> tuple[list, list[LinearArgs], DeltaArgs] | None:
    """A layer's token mixer: (q_norm and k_norm weights, q/k/v/o args, DeltaArgs()) for
    attention, ([None, None], four empty args, its DeltaArgs) for a Gated DeltaNet; None where the
    kernel does not take it."""
    d, hd = cfg.hidden_size, cfg.head_dim
    if hasattr(layer, "linear_attn"):
        m = layer.linear_attn
        c, vd, hv = cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        linears = checked((m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a, m.out_proj),
                          [(c, d), (vd, d), (hv, d), (hv, d), (d, vd)], dtype)
        floats = [m.conv1d.weight, m.dt_bias, m.A_log, m.norm.weight]
        if linears is None or not float_tensors(floats, [c * cfg.linear_conv_kernel_dim, hv, hv, cfg.linear_value_head_dim],
                                                dtype):
            return None
        delta = DeltaArgs(*linears, *(t.data_ptr() for t in floats))
        delta.tensors = floats + [t for a in linears for t in a.tensors]
        return [None, None], [LinearArgs()] * 4, delta
    attn = layer.self_attn
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    q_rows = q_out * (2 if cfg.attn_output_gate else 1)
    linears = checked((attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj),
                      [(q_rows, d), (kv_out, d), (kv_out, d), (d, q_out)], dtype)
    norms = [attn.q_norm.weight, attn.k_norm.weight]
    if linears is None or not float_tensors(norms, [hd, hd], dtype):
        return None
    return norms, linears, DeltaArgs()


def mlp_args(model: nn.Module, mlp: nn.Module, dtype: torch.dtype) -> tuple[list[LinearArgs], MoeArgs] | None:
    """A layer's MLP: (gate/up/down args, MoeArgs()) when dense, (its shared expert's gate/up/down
    or three empty args, its MoeArgs) for a mixture; None where the kernel does not take it."""
    cfg, d = model.cfg, model.cfg.hidden_size
    if hasattr(mlp, "gate_proj"):
        inter = cfg.intermediate_size
        linears = checked((mlp.gate_proj, mlp.up_proj, mlp.down_proj), [(inter, d), (inter, d), (d, inter)], dtype)
        return None if linears is None else (linears, MoeArgs())
    moe = moe_args(model, mlp, dtype)
    if moe is None:
        return None
    if not hasattr(mlp, "shared_expert"):
        return [LinearArgs()] * 3, moe
    inter, shared = cfg.shared_expert_intermediate_size, mlp.shared_expert
    linears = checked((shared.gate_proj, shared.up_proj, shared.down_proj), [(inter, d), (inter, d), (d, inter)],
                      dtype)
    return None if linears is None else (linears, moe)


def layer_args(model: nn.Module) -> ctypes.Array | bool:
    """The layers' weights for decode_layers, or False (a layer whose decode products are not the
    GEMV, mixed dtypes, shapes other than the config's). Built once: the weights are fixed after
    loading."""
    cfg, dtype = model.cfg, model.norm.weight.dtype
    args, tensors = [], []
    for layer in model.layers:
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        mixer, mlp = mixer_args(cfg, layer, dtype), mlp_args(model, layer.mlp, dtype)
        if mixer is None or mlp is None or not float_tensors(norms, [cfg.hidden_size] * 2, dtype):
            return False
        (qk_norms, mixing, delta), (mlp_linears, moe) = mixer, mlp
        norms += qk_norms
        args.append(LayerArgs(*(0 if n is None else n.data_ptr() for n in norms), *mixing, *mlp_linears, moe, delta))
        tensors += [n for n in norms if n is not None]
        tensors += [t for a in mixing + mlp_linears + [moe, delta] for t in getattr(a, "tensors", [])]
    array = (LayerArgs * len(args))(*args)
    array.tensors = tensors  # keeps every pointed-to tensor alive as long as the array
    array.dtype = dtype
    array.shape = ShapeArgs.of(cfg)
    return array
