"""Caches keyed by content: image features by image hash and whole answers by the exact
request, both bounded LRU maps. (KV states by token prefix live in the KV pool's unused
blocks: qvl.kv_cache.) Every key includes the request's cache salt (Request.cache_salt):
requests of different salts share nothing, so neither a cache flag nor a faster answer tells
one client what another asked."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch



@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class LRU:
    """An LRU map bounded by a byte budget (or an entry count); thread-safe."""

    def __init__(self, max_bytes: int = 0, max_entries: int = 0):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.stats = CacheStats()
        self.lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or self.max_entries > 0

    def get(self, key) -> Any | None:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                self.stats.hits += 1
                return self.items[key][0]
            self.stats.misses += 1
            return None

    def put(self, key, value, size: int = 0) -> None:
        if not self.enabled or (self.max_bytes and size > self.max_bytes):
            return
        with self.lock:
            if key in self.items:
                self.stats.bytes -= self.items.pop(key)[1]
            self.items[key] = (value, size)
            self.stats.bytes += size
            while (self.max_bytes and self.stats.bytes > self.max_bytes) or (
                self.max_entries and len(self.items) > self.max_entries
            ):
                _, (_, freed) = self.items.popitem(last=False)
                self.stats.bytes -= freed
                self.stats.evictions += 1
            self.stats.entries = len(self.items)

    def snapshot(self) -> list[tuple]:
        """(key, value) pairs, oldest first, read under the lock."""
        with self.lock:
            return [(k, v) for k, (v, _) in self.items.items()]

    def touch(self, key) -> None:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)


@dataclass
class ImageFeatures:
    embeds: torch.Tensor  # [n, D]
    deepstack: list[torch.Tensor]  # each [n, D]

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes + sum(d.nbytes for d in self.deepstack)


class VisionCache(LRU):
    """The vision tower's output per cache salt and image content hash (pixels + preprocessing)."""

    def __init__(self, max_mb: float):
        super().__init__(max_bytes=int(max_mb * 2**20))

    def find(self, salt: str, content_hash: str) -> ImageFeatures | None:
        return self.get((salt, content_hash))

    def add(self, salt: str, content_hash: str, features: ImageFeatures) -> None:
        self.put((salt, content_hash), features, features.nbytes)


def image_spans(is_image: torch.Tensor, hashes: list[str]) -> list[tuple[int, int, str]]:
    """(start, end, hash) of each run of image (or video frame) tokens, in order; is_image: [T] bool."""
    is_image = is_image.int()
    edges = torch.diff(torch.cat([torch.tensor([0]), is_image, torch.tensor([0])]))
    starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    return [(s, e, h) for s, e, h in zip(starts, ends, hashes)]


class AnswerCache(LRU):
    """Final answers of deterministic requests, by a key over everything that shapes them."""

    def __init__(self, max_entries: int):
        super().__init__(max_entries=max_entries)

    @staticmethod
    def key(model_id: str, ids: torch.Tensor, image_hashes: list[str], params: Any, salt: str = "") -> str:
        h = hashlib.sha256(hashlib.sha256(salt.encode()).digest())  # fixed length: no salt runs into the rest
        h.update(model_id.encode())
        h.update(ids.numpy().tobytes())
        h.update("|".join(image_hashes).encode())
        h.update(repr(params).encode())
        return h.hexdigest()
