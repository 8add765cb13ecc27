"""Bidirectional attention for long vision sequences, in blocks of queries.

torch's fused CPU attention kernel is slow for thousands of keys at head_dim 64 (the
vision tower). Two GEMMs and a softmax per block of queries are faster, and the block
size bounds the score matrix's memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORES_BUDGET_BYTES = 64 * 2**20  # score matrix per block of queries
BLOCKWISE_MIN_KEYS = 1024  # below this the fused kernel is as fast


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v: [H, N, d] -> [H, N, d]; full (non-causal) softmax attention."""
    heads, n, d = q.shape
    if n < BLOCKWISE_MIN_KEYS:
        return F.scaled_dot_product_attention(q, k, v)
    block = max(16, min(n, SCORES_BUDGET_BYTES // (heads * n * q.element_size())))
    kt = k.transpose(1, 2)
    q = q * d**-0.5
    out = torch.empty_like(q)
    for s in range(0, n, block):
        scores = torch.matmul(q[:, s : s + block], kt)  # [H, b, N]
        out[:, s : s + block] = torch.matmul(scores.softmax(-1), v)
    return out
