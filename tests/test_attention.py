"""Blockwise vision attention equals torch's fused attention."""

import pytest
import torch
import torch.nn.functional as F

from qvl.model import attention


@pytest.mark.parametrize("n", [1100, 2500])
def test_blockwise_attention_matches_sdpa(monkeypatch, n):
    monkeypatch.setattr(attention, "SCORES_BUDGET_BYTES", 4 * 2**20)  # force several blocks
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(3, n, 16, generator=g) for _ in range(3))
    out = attention.blockwise_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-4)
