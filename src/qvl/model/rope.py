"""Rotary position embeddings: interleaved M-RoPE for the text decoder (3-D positions)
and the axial 2-D RoPE of the vision tower."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., D]; cos/sin broadcastable to x."""
    return x * cos + rotate_half(x) * sin


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """[dim // 2] float32: theta^(-2i/dim), on the CPU even while a model is built on the meta
    device (a meta arange imports sympy and ~800 other modules: ~70 MB for good)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int], interleaved: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text M-RoPE tables.

    positions: [3, B, T] (temporal, height, width) -> cos, sin: [B, 1, T, head_dim].
    Interleaved layout (Qwen3-VL): frequency i takes its position from axis H when
    i % 3 == 1 (i < 3*section[1]), from W when i % 3 == 2 (i < 3*section[2]), else T.
    """
    freqs = positions[..., None].float() * inv_freq  # [3, B, T, D/2]
    if interleaved:
        mixed = freqs[0].clone()
        for axis in (1, 2):
            idx = slice(axis, 3 * section[axis], 3)
            mixed[..., idx] = freqs[axis, ..., idx]
    else:  # chunked layout (Qwen2-VL style): consecutive sections per axis
        chunks = freqs.split(list(section), dim=-1)
        mixed = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
    emb = torch.cat((mixed, mixed), dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def vision_cos_sin(hw_positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2-D RoPE tables for the vision tower.

    hw_positions: [N, 2] (row, col) -> cos, sin: [N, 1, head_dim] float32, where
    inv_freq has head_dim // 4 entries shared by the row and column axes.
    """
    freqs = hw_positions[..., None].float() * inv_freq  # [N, 2, D/4]
    hw = freqs.flatten(1)  # [N, D/2]: row freqs then column freqs
    emb = torch.cat((hw, hw), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def mrope_positions(
    ids: torch.Tensor, grids: list[tuple[int, int, int]], is_image: torch.Tensor, merge: int, offset: int = 0
) -> tuple[torch.Tensor, int]:
    """3-D positions of a prompt whose images (and video frame pairs, placed as images) sit
    where `is_image` [T] bool is true.

    ids: [T] long; grids: (t, h, w) in patches of each image, in order. Text advances
    all three axes together; an image's tokens take (start, start + row, start + col)
    and the text after it resumes at start + max(rows, cols).
    Returns positions [3, T] and the position of the token that would follow.
    """
    image_at = is_image.nonzero().flatten().tolist()
    parts, cursor, pos, k = [], 0, offset, 0
    for grid in grids:
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        first = image_at[k]
        n_text = first - cursor
        parts.append(torch.arange(pos, pos + n_text).expand(3, -1))
        pos += n_text
        tt = torch.arange(t).view(t, 1, 1).expand(t, h, w).flatten()
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w).flatten()
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w).flatten()
        parts.append(torch.stack([tt, hh, ww]) + pos)
        pos += max(h, w)
        cursor = first + t * h * w
        k += t * h * w
    if k != len(image_at):
        raise ValueError(f"prompt has {len(image_at)} image tokens but the images need {k}")
    n_text = ids.shape[0] - cursor
    parts.append(torch.arange(pos, pos + n_text).expand(3, -1))
    return torch.cat(parts, dim=1), pos + n_text
