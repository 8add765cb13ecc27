"""Preallocated key/value cache for the text decoder."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every decoder layer for B rows and up to `capacity` positions.

    keys, values: [L, B, H_kv, capacity, head_dim]. `length` counts the positions
    filled; layers write at `start` through `update` and read everything before it.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 zeroed: bool = False):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        alloc = torch.zeros if zeroed else torch.empty  # empty: pages become resident only when written
        self.keys = alloc(shape, dtype=dtype)
        self.values = alloc(shape, dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_position(self) -> int:
        """Keys and values of one position of one row, all layers."""
        return self.nbytes // (self.keys.shape[1] * self.capacity)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, hd] written at positions start..start+T.
        Returns the layer's keys and values for positions 0..start+T: [B, H_kv, start+T, hd]."""
        end = start + k.shape[2]
        self.check_room(end)
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def check_room(self, end: int) -> None:
        """Raise ValueError unless positions up to `end` fit (before anything is written)."""
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.capacity}")

    def write_prefix(self, other: KVCache, length: int, slot: int = 0) -> None:
        """Copy the first `length` positions of a B=1 cache into slots slot..slot+length."""
        self.keys[:, :, :, slot : slot + length] = other.keys[:, :1, :, :length]
        self.values[:, :, :, slot : slot + length] = other.values[:, :1, :, :length]

    def clone_row(self, row: int, slot: int, length: int) -> KVCache:
        """A compact B=1 copy of positions slot..slot+length of one row."""
        new = KVCache.__new__(KVCache)
        new.keys = self.keys[:, row : row + 1, :, slot : slot + length].clone()
        new.values = self.values[:, row : row + 1, :, slot : slot + length].clone()
        new.length = length
        return new

    def row(self, r: int) -> KVCache:
        """A view of row r as a B=1 cache sharing this cache's storage."""
        view = KVCache.__new__(KVCache)
        view.keys = self.keys[:, r : r + 1]
        view.values = self.values[:, r : r + 1]
        view.length = self.length
        return view
