"""Gated DeltaNet, the linear-attention layer of Qwen3.5/3.6's hybrid decoder.

in_proj_qkv -> a depthwise causal convolution (SiLU) over q, k, v -> the gated delta rule
(q and k L2-normalised, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)) on a float32
state per value head -> a gated RMSNorm (norm(out) * silu(z)) -> out_proj. Each sequence keeps
the convolution's last inputs and the delta rule's state (qvl.state_cache) instead of keys and
values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qvl.config import TextConfig
from qvl.kernels import ops
from qvl.kv_cache import KVCache


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, scaled by `weight`, times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., dim] -> [..., dim] in x's dtype
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """`index`: which linear layer this is (its row of the state pool)."""

    def __init__(self, cfg: TextConfig, index: int):
        super().__init__()
        self.index = index
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, groups=cfg.conv_dim,
                                bias=False)  # only its weight [C, 1, K] is used
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache, start: int | torch.Tensor,
                queries: int | None = None) -> torch.Tensor:
        """x: [B, T, D] at positions start..start+T of each row (start an int: a prefill, each
        row's state taken on from where it stands), or one token per row (start [B]: decode).
        The rows' states (cache.states) move past these tokens. Returns [B, T, D], or with
        `queries` the last `queries` positions only."""
        b, t, _ = x.shape
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        z = self.in_proj_z(x)  # [B, T, Hv*Dv]
        beta = self.in_proj_b(x).sigmoid().float()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0]  # [C, K]
        states = cache.states
        if isinstance(start, torch.Tensor):
            y = ops.causal_conv_step(mixed[:, 0], weight, states.pool.conv[self.index], states.slots)
            q, k, v = self._heads(y)
            out = ops.gated_delta_step(q, k, v, g[:, 0], beta[:, 0], states.pool.recurrent[self.index],
                                       states.slots)[:, None]  # [B, 1, Hv, Dv]
        else:
            out = torch.stack([self._prefill_row(mixed[r], g[r], beta[r], weight, states.row(r), start)
                               for r in range(b)])
        if queries is not None:
            out, z = out[:, t - queries :], z[:, t - queries :]
        n = out.shape[1]
        out = self.norm(out, z.view(b, n, self.v_heads, self.v_dim)).reshape(b, n, -1)
        return self.out_proj(out)

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # y: [..., C] -> q, k [..., Hk, Dk], v [..., Hv, Dv]
        q, k, v = y.split([self.k_heads * self.k_dim, self.k_heads * self.k_dim, self.v_heads * self.v_dim], -1)
        lead = y.shape[:-1]
        return (q.view(*lead, self.k_heads, self.k_dim), k.view(*lead, self.k_heads, self.k_dim),
                v.view(*lead, self.v_heads, self.v_dim))

    def _prefill_row(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                     states, start: int) -> torch.Tensor:
        """One row's tokens: mixed [T, C], g, beta [T, Hv] -> [T, Hv, Dv]. Its state (slot
        states.slots[0]) moves past them; where the call captures snapshots, this layer's state
        at those positions is copied into them on the way."""
        slot = int(states.slots[0])
        conv_state, state = states.pool.conv[self.index, slot], states.pool.recurrent[self.index, slot]
        t = mixed.shape[0]
        outs, s = [], 0
        for e, snapshot in [*((p - start, c) for p, c in zip(states.capture, states.captured)), (t, None)]:
            if e > s:
                q, k, v = self._heads(ops.causal_conv(mixed[s:e], weight, conv_state))
                outs.append(ops.gated_delta_rule(q, k, v, g[s:e], beta[s:e], state, start + s))
            if snapshot is not None:
                snapshot.conv[self.index] = conv_state
                snapshot.recurrent[self.index] = state
            s = e
        return torch.cat(outs) if len(outs) > 1 else outs[0]
