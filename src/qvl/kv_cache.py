"""Preallocated key/value cache for the text decoder."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every decoder layer for B rows and up to `capacity` positions.

    keys, values: [L, B, H_kv, capacity, head_dim]. Every row starts at slot 0 and holds only
    its own positions; how many each row has filled is the generation loop's to track (the
    cache does not count), and layers write where they are told through `update`.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        # empty: pages become resident only when written, and no row reads a slot it has not written
        self.keys = torch.empty(shape, dtype=dtype)
        self.values = torch.empty(shape, dtype=dtype)

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

    def update(self, layer: int, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, hd]. start an int: the cache's B rows write positions
        start..start+T; returns the layer's keys and values [B, H_kv, start+T, hd]. start [B]
        slots (one token per row, T = 1): batch row b writes cache row rows[b] (default b) at
        start[b]; returns every cache row's [R, H_kv, max(start)+1, hd], of which batch row b
        may read only row rows[b]'s first start[b]+1 positions."""
        if isinstance(start, int):
            end = start + k.shape[2]
            self.check_room(end)
            self.keys[layer, :, :, start:end] = k
            self.values[layer, :, :, start:end] = v
        else:
            end = int(start.max()) + 1
            self.check_room(end)
            rows = torch.arange(k.shape[0]) if rows is None else rows
            self.keys[layer, rows, :, start] = k[:, :, 0]
            self.values[layer, rows, :, start] = v[:, :, 0]
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def check_room(self, end: int) -> None:
        """Raise ValueError unless positions up to `end` fit (before anything is written)."""
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.capacity}")

    def copy_row(self, source: KVCache, source_row: int, row: int, length: int) -> None:
        """Copy the first `length` positions of `source`'s row `source_row` into this cache's
        row `row` (`source` may be this cache)."""
        self.keys[:, row, :, :length] = source.keys[:, source_row, :, :length]
        self.values[:, row, :, :length] = source.values[:, source_row, :, :length]

    def clone_row(self, row: int, length: int) -> KVCache:
        """A compact B=1 copy of the first `length` positions of one row."""
        new = KVCache.__new__(KVCache)
        new.keys = self.keys[:, row : row + 1, :, :length].clone()
        new.values = self.values[:, row : row + 1, :, :length].clone()
        return new

    def row(self, r: int) -> KVCache:
        """A view of row r as a B=1 cache sharing this cache's storage."""
        view = KVCache.__new__(KVCache)
        view.keys = self.keys[:, r : r + 1]
        view.values = self.values[:, r : r + 1]
        return view
