"""The KV cache: keys and values of every decoder layer in one pool of fixed-size blocks.

A sequence holds a list of blocks, its block table: its position j lives in block
table[j // BLOCK] at slot j % BLOCK. Blocks are reference-counted, so sequences share them:
the n answers of one request share their prompt's blocks (a shared block is copied before one
of them writes into it), and requests that begin alike (the same tokens and the same images)
share the full blocks of that beginning. A full block is known by a hash of every token and
image up to its end, seeded by the request's cache salt (requests of other salts share
nothing); once no sequence holds it, it stays as the prefix cache (least recently used first
out, within its own byte cap) until the pool needs its memory.
"""

from __future__ import annotations

import array
import hashlib
import heapq
import math
import mmap
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qvl.cache import CacheStats

if TYPE_CHECKING:
    from qvl.state_cache import Snapshot, StateRows

BLOCK = 16  # positions per block: a shared prefix wastes at most BLOCK - 1 recomputed tokens


class KVPool:
    """keys, values: [L, blocks, H_kv, BLOCK, head_dim]. Memory becomes resident only where
    written; released blocks are handed out again (lowest first) before blocks never used, so
    the pages in use stay few."""

    def __init__(self, layers: int, blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 prefix_max_bytes: int = 0):
        if blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        shape = (layers, blocks, kv_heads, BLOCK, head_dim)
        self.keys, self.values = unreserved((2, *shape), dtype).unbind(0)
        self.refs = array.array("i", bytes(4 * blocks))  # holders per block
        self.free: list[int] = []  # a heap of released blocks (resident: taken before fresh ones)
        self.fresh = 0  # blocks fresh..blocks-1 were never handed out
        self.hash_of: dict[int, bytes] = {}  # full blocks whose content is known by prefix hash
        self.by_hash: dict[bytes, int] = {}
        self.unused: OrderedDict[int, int] = OrderedDict()  # hashed blocks no sequence holds -> when released
        # hybrid models: recurrent-state snapshots by the prefix hash of the block they follow,
        # least recently used first -> (snapshot, when last used)
        self.snapshots: OrderedDict[bytes, tuple[Snapshot, int]] = OrderedDict()
        self.snapshot_bytes = 0
        self.clock = 0  # counts releases and snapshot uses: the older of a block and a snapshot goes first
        self.max_bytes = prefix_max_bytes  # what the unused hashed blocks and the snapshots (the prefix cache) may keep
        self.stats = CacheStats()  # the prefix cache's: hits, misses, evictions, bytes, entries (blocks)

    @property
    def blocks(self) -> int:
        return self.keys.shape[1]

    @property
    def block_bytes(self) -> int:
        """Keys and values of one block, all layers."""
        return 2 * self.keys[:, 0].nbytes

    @property
    def enabled(self) -> bool:
        """Whether full blocks are kept for reuse by later requests (the prefix cache)."""
        return self.max_bytes >= self.block_bytes

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free ones and the prefix cache's."""
        return len(self.free) + self.blocks - self.fresh + len(self.unused)

    @property
    def held(self) -> int:
        """Blocks some sequence holds."""
        return self.blocks - self.available

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one holder (free ones first, then the prefix cache's oldest), or None
        (nothing taken) when fewer are available."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                block = heapq.heappop(self.free)
            elif self.fresh < self.blocks:
                block, self.fresh = self.fresh, self.fresh + 1
            else:
                block, _ = self.unused.popitem(last=False)
                self._forget(block)
                self.stats.evictions += 1
            self.refs[block] = 1
            out.append(block)
        self._count()
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of these blocks (taking them out of the prefix cache)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.unused[block]
            self.refs[block] += 1
        self._count()

    def release(self, blocks: list[int]) -> None:
        """One holder fewer; a block nobody holds joins the prefix cache if it is hashed (and
        the cache is on), else the free blocks. A sequence's blocks join from its last one
        back, so that eviction takes the ends of prefixes before their beginnings."""
        self.clock += 1
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if block in self.hash_of and self.enabled:
                self.unused[block] = self.clock
            else:
                self._forget(block)
                heapq.heappush(self.free, block)
        self._trim()

    def keep_snapshot(self, digest: bytes, snapshot: Snapshot) -> None:
        """Keep the recurrent state after the block whose prefix hash is `digest` (a hashed
        block), within the prefix cache's bytes; it goes with that block."""
        if not self.enabled or digest not in self.by_hash or snapshot.nbytes > self.max_bytes:
            return
        self._drop_snapshot(digest)
        self.clock += 1
        self.snapshots[digest] = (snapshot, self.clock)
        self.snapshot_bytes += snapshot.nbytes
        self._trim()

    def snapshot_after(self, digest: bytes) -> Snapshot | None:
        """The snapshot kept after the block of prefix hash `digest` (now the most recently used)."""
        if digest not in self.snapshots:
            return None
        self.clock += 1
        snapshot, _ = self.snapshots.pop(digest)
        self.snapshots[digest] = (snapshot, self.clock)
        return snapshot

    def _drop_snapshot(self, digest: bytes) -> None:
        if (kept := self.snapshots.pop(digest, None)) is not None:
            self.snapshot_bytes -= kept[0].nbytes

    def _trim(self) -> None:
        """Evict the least recently used unused blocks and snapshots until they fit max_bytes."""
        while len(self.unused) * self.block_bytes + self.snapshot_bytes > self.max_bytes:
            block, released = next(iter(self.unused.items()), (None, None))
            digest, kept = next(iter(self.snapshots.items()), (None, None))
            if block is None or (kept is not None and kept[1] < released):  # the snapshot is older
                self._drop_snapshot(digest)
            else:
                del self.unused[block]
                self._forget(block)
                heapq.heappush(self.free, block)
            self.stats.evictions += 1
        self._count()

    def register(self, block: int, digest: bytes) -> None:
        """Mark a full block as holding the prefix `digest` (block_hashes), so later requests
        may share it. A digest already held by another block keeps that one."""
        if self.enabled and block not in self.hash_of and digest not in self.by_hash:
            self.hash_of[block] = digest
            self.by_hash[digest] = block

    def lookup(self, digests: list[bytes]) -> list[int]:
        """The blocks holding the longest run of these prefix hashes from the first on."""
        out = []
        for digest in digests:
            block = self.by_hash.get(digest)
            if block is None:
                break
            out.append(block)
        return out

    def copy_block(self, source: int, target: int) -> None:
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]

    def _forget(self, block: int) -> None:
        digest = self.hash_of.pop(block, None)
        if digest is not None:
            del self.by_hash[digest]
            self._drop_snapshot(digest)

    def _count(self) -> None:
        self.stats.entries = len(self.unused) + len(self.snapshots)
        self.stats.bytes = len(self.unused) * self.block_bytes + self.snapshot_bytes


def unreserved(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose memory becomes resident only where written and is not counted
    against the system's commit limit (an anonymous MAP_NORESERVE mapping on Linux): a
    budget-sized pool costs nothing until used, and does not make the process's fork()s fail
    (with the kernel's overcommit heuristic, a process holding several untouched multi-GB
    pools could not start a subprocess once Ray had run in it). Elsewhere torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if sys.platform != "linux" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    memory = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK)


def block_hashes(ids: torch.Tensor, spans: list[tuple[int, int, str]], count: int,
                 known: list[bytes] = (), salt: str = "") -> list[bytes]:
    """The prefix hash of each of the first `count` full blocks of a sequence: its tokens ids
    [T] and every image (or video frame group) among them, (start, end, content hash), from
    the first token to the block's end. `known`: the hashes of its first blocks, already
    computed (the chain goes on from them). `salt` (the request's cache salt) seeds the
    chain, so only requests of the same salt find each other's blocks."""
    out = list(known[:count])
    digest = out[-1] if out else salt_seed(salt)
    ids = ids.to(torch.int64)
    for i in range(len(out), count):
        start, end = i * BLOCK, (i + 1) * BLOCK
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(ids[start:end].numpy().tobytes())
        for s, e, content in spans:
            if s < end and e > start:
                h.update(f"{s},{e},{content};".encode())
        digest = h.digest()
        out.append(digest)
    return out


def salt_seed(salt: str) -> bytes:
    """What a salted chain starts from: a digest of the salt (b"" for none, as before salts)."""
    return hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""


@dataclass
class KVCache:
    """What one model call reads and writes: the pool and the block tables of its B rows,
    table [B, max_blocks] int64 (-1 past a row's blocks). Which positions a row holds is the
    caller's to know; the model writes where it is told."""

    pool: KVPool
    table: torch.Tensor
    states: StateRows | None = None  # the rows' recurrent states (hybrid models' linear layers)

    @property
    def capacity(self) -> int:
        """Positions the table's rows have room for."""
        return self.table.shape[1] * BLOCK

    def row(self, r: int) -> KVCache:
        return KVCache(self.pool, self.table[r : r + 1], None if self.states is None else self.states.row(r))

    def locate(self, start: int | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks and slots [B, T] of positions start..start+length of each row (start an
        int), or of position start[b] of row b (length 1). ValueError past a row's blocks."""
        b = self.table.shape[0]
        pos = torch.arange(start, start + length).expand(b, length) if isinstance(start, int) else start[:, None]
        if int(pos.max()) >= self.capacity:
            raise ValueError(f"KV cache overflow: position {int(pos.max())} >= capacity {self.capacity}")
        blocks = self.table.gather(1, pos // BLOCK)
        if bool((blocks < 0).any()):
            raise ValueError("KV cache overflow: a position past its row's blocks")
        return blocks, pos % BLOCK

    def write(self, layer: int, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, H_kv, T, hd] at positions start..start+T of every row (start an int), or
        [B, H_kv, 1, hd] at position start[b] of row b (start [B])."""
        blocks, slots = self.locate(start, k.shape[2])
        self.pool.keys[layer][blocks, :, slots] = k.transpose(1, 2)
        self.pool.values[layer][blocks, :, slots] = v.transpose(1, 2)

    def gather(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the rows' first `length` positions, copied contiguous:
        [B, H_kv, length, hd] each (rows shorter than `length` hold other data past their end)."""
        table = self.table[:, : blocks_for(length)].clamp(min=0)
        b, n = table.shape

        def rows(pool: torch.Tensor) -> torch.Tensor:
            x = pool[layer][table]  # [B, n, H_kv, BLOCK, hd]
            return x.permute(0, 2, 1, 3, 4).reshape(b, x.shape[2], n * BLOCK, x.shape[4])[:, :, :length]

        return rows(self.pool.keys), rows(self.pool.values)


def contiguous_cache(layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                     dtype: torch.dtype) -> KVCache:
    """A pool of its own for `batch` rows of `capacity` positions each (row b: blocks
    b*n..(b+1)*n-1): for one-off model calls (tests, warm-up, calibration)."""
    n = blocks_for(max(capacity, 1))
    pool = KVPool(layers, batch * n, kv_heads, head_dim, dtype)
    return KVCache(pool, torch.arange(batch * n, dtype=torch.int64).view(batch, n))
