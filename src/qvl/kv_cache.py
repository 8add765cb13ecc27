"""Preallocated key/value cache for the text decoder."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every decoder layer for B rows and up to `capacity` positions.

    keys, values: [L, B, H_kv, capacity, head_dim]. `length` counts the positions
    filled; layers write at `start` through `update` and read everything before it.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, hd] written at positions start..start+T.
        Returns the layer's keys and values for positions 0..start+T: [B, H_kv, start+T, hd]."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.capacity}")
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def trim(self, length: int) -> None:
        """Forget positions from `length` on (their slots are overwritten later)."""
        self.length = min(self.length, length)

    def copy_prefix_from(self, other: KVCache, length: int, row: int = 0) -> None:
        """Copy the first `length` positions of `other`'s row into every row of this cache."""
        self.keys[:, :, :, :length] = other.keys[:, row : row + 1, :, :length]
        self.values[:, :, :, :length] = other.values[:, row : row + 1, :, :length]
        self.length = length

    def clone_prefix(self, length: int, row: int = 0) -> KVCache:
        """A compact copy of one row's first `length` positions (for prefix reuse)."""
        new = KVCache.__new__(KVCache)
        new.keys = self.keys[:, row : row + 1, :, :length].clone()
        new.values = self.values[:, row : row + 1, :, :length].clone()
        new.length = length
        return new

    def row(self, r: int) -> KVCache:
        """A view of row r as a B=1 cache sharing this cache's storage."""
        view = KVCache.__new__(KVCache)
        view.keys = self.keys[:, r : r + 1]
        view.values = self.values[:, r : r + 1]
        view.length = self.length
        return view
