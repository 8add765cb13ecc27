"""Causal prefill attention of one row over the paged cache at head size 256 (Qwen3.5's
full-attention layers: 8 query heads over 2 key/value heads in the 2B, 24 over 4 in the 27B) on
the AVX512-BF16 flash kernel: as SDPA in float64, and a prompt token's bits the same whatever
the slice of the prompt it is computed in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qvl.kernels import attention
from qvl.kv_cache import BLOCK
from tests.test_native import AMX, _paged_rows, _row_positions, lib, needs_attention

D = 256
pytestmark = [needs_attention,
              pytest.mark.skipif(AMX, reason="AMX builds run prefill attention on tiles, which take heads up to 128")]


def _dominant_late_keys(keys: torch.Tensor, table: torch.Tensor, length: int) -> None:
    """Scale up three keys three quarters into the row: rows that see them have their running max
    move after their output has accumulated."""
    for j in range(length * 3 // 4, length * 3 // 4 + 3):
        keys[table[j // BLOCK], :, j % BLOCK] *= 6


def _sdpa_float64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                  start: int) -> torch.Tensor:
    """The float64 reference of paged_attention: q [T, H, D] at positions start.. over the row's
    first start + T positions, laid out contiguously -> [T, H, D]."""
    length = start + q.shape[0]
    k, v = (_row_positions(x, table, length).double() for x in (keys, values))
    mask = torch.arange(length)[None, :] <= torch.arange(start, length)[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k[None], v[None],
                                          attn_mask=mask[None, None], enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("length, start, heads, kv_heads", [
    (1, 0, 8, 2), (31, 0, 8, 2), (100, 0, 24, 4), (100, 37, 8, 2), (2000, 1936, 8, 2), (2000, 1901, 24, 4)])
def test_head_256_prefill_matches_float64_sdpa(length, start, heads, kv_heads):
    """Queries at positions start..length over the row's blocks (shuffled in the pool, spare
    blocks NaN and never read), grouped 4 or 6 query heads per key/value head, a few late keys
    dominating: as SDPA in float64, to bf16's precision."""
    keys, values, table = _paged_rows(1, kv_heads, length, D)
    _dominant_late_keys(keys, table[0], length)
    q = (torch.randn(length - start, heads, D) * 2).bfloat16()
    out = attention.paged_attention(lib, q, keys, values, table[0], start)
    assert out is not None and out.shape == q.shape and out.dtype == torch.bfloat16
    ref = _sdpa_float64(q, keys, values, table[0], start)
    torch.testing.assert_close(out.double(), ref, atol=2e-2 * max(1.0, ref.abs().max().item()), rtol=2e-2)


@pytest.mark.parametrize("length, heads, kv_heads, cuts", [
    (150, 8, 2, ((0, 1, 17, 48, 150), (0, 25, 50, 75, 100, 125, 150), (0, 3, 4, 149, 150))),
    (150, 24, 4, ((0, 64, 65, 150), (0, 1, 2, 3, 150))),
    (2000, 8, 2, ((1936, 2000), (1999, 2000), (700, 1300, 1301, 2000)))])
def test_head_256_prefill_gives_a_row_the_same_bits_in_any_slice(length, heads, kv_heads, cuts):
    """A prompt prefilled in slices (each over the cache the earlier ones filled; cut: the
    slices' bounds) leaves every query row the bits one call over the whole prompt gives it:
    a Qwen3.5 request's tokens do not depend on how the scheduler cut its prompt."""
    keys, values, table = _paged_rows(1, kv_heads, length, D)
    _dominant_late_keys(keys, table[0], length)
    q = (torch.randn(length, heads, D) * 2).bfloat16()
    q[length // 2 : length // 2 + 3] *= 8  # rows whose scores are large: their running max moves
    whole = attention.paged_attention(lib, q, keys, values, table[0], 0)
    assert whole is not None
    for cut in cuts:
        parts = [attention.paged_attention(lib, q[a:b], keys, values, table[0], a) for a, b in zip(cut, cut[1:])]
        assert torch.equal(torch.cat(parts), whole[cut[0]:]), cut
