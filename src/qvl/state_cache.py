"""The recurrent state of the hybrid models' Gated DeltaNet layers (Qwen3.5/3.6).

Per sequence and linear layer: the convolution's last K-1 inputs [C, K-1] (model dtype) and
the delta rule's state [Hv, Dk, Dv] (float32). They live in one pool of slots, one per
running row. Unlike keys and values they cannot be cut back to an earlier position, so the
prefix cache keeps snapshots of them at positions that are multiples of SNAPSHOT_INTERVAL
(qvl.kv_cache.KVPool keeps them beside its blocks): a request whose prompt begins with a
snapshotted prefix starts from the snapshot and prefills only the rest.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from qvl.config import TextConfig
from qvl.kv_cache import BLOCK, unreserved

# positions between the snapshots a prefill keeps: a multiple of the delta rule's chunk, whose
# boundaries fall on absolute positions, so a row resumed from a snapshot computes what one
# prefill of the whole prompt computes
SNAPSHOT_INTERVAL = 64
SNAPSHOT_BLOCKS = SNAPSHOT_INTERVAL // BLOCK


@dataclass
class Snapshot:
    """Every linear layer's state after some position of one sequence."""

    conv: torch.Tensor  # [L, C, K-1] model dtype
    recurrent: torch.Tensor  # [L, Hv, Dk, Dv] float32

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


class StatePool:
    """conv [L, slots, C, K-1], recurrent [L, slots, Hv, Dk, Dv]; L: the linear layers. Memory
    becomes resident only where written; released slots are handed out again lowest first."""

    def __init__(self, cfg: TextConfig, slots: int, dtype: torch.dtype):
        layers = len(cfg.linear_layers)
        self.conv = unreserved((layers, slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), dtype)
        self.recurrent = unreserved((layers, slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                     cfg.linear_value_head_dim), torch.float32)
        self.free = list(range(slots))

    @property
    def slots(self) -> int:
        return self.conv.shape[1]

    @property
    def slot_bytes(self) -> int:
        """One sequence's state, all linear layers."""
        return self.conv[:, 0].nbytes + self.recurrent[:, 0].nbytes

    def allocate(self, snapshot: Snapshot | None = None) -> int:
        """A slot holding `snapshot`, or the state before a prompt's first token (zeros).
        RuntimeError when every slot is taken (the scheduler takes one per row it runs)."""
        if not self.free:
            raise RuntimeError(f"all {self.slots} recurrent-state slots are taken")
        slot = heapq.heappop(self.free)
        if snapshot is None:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
        else:
            self.conv[:, slot] = snapshot.conv
            self.recurrent[:, slot] = snapshot.recurrent
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)

    def copy(self, source: int, target: int) -> None:
        self.conv[:, target] = self.conv[:, source]
        self.recurrent[:, target] = self.recurrent[:, source]

    def snapshot(self, slot: int) -> Snapshot:
        return Snapshot(self.conv[:, slot].clone(), self.recurrent[:, slot].clone())

    def empty_snapshot(self) -> Snapshot:
        return Snapshot(torch.empty_like(self.conv[:, 0]), torch.empty_like(self.recurrent[:, 0]))


@dataclass
class StateRows:
    """What one model call reads and writes of the recurrent states: row b's state is slot
    slots[b] of the pool. A prefill of one row may also `capture` the state after some absolute
    positions (multiples of SNAPSHOT_INTERVAL inside the call, ascending): the layers copy it
    into `captured[i]` as they pass position capture[i]."""

    pool: StatePool
    slots: torch.Tensor  # [B] int64
    capture: tuple[int, ...] = ()
    captured: tuple[Snapshot, ...] = ()

    def row(self, r: int) -> StateRows:
        return StateRows(self.pool, self.slots[r : r + 1], self.capture, self.captured)


SNAPSHOT_EVERY = 1024  # positions between the snapshots a long prefill keeps besides the ones below


def capture_points(start: int, end: int, turn: int | None = None) -> list[int]:
    """Where a prefill of positions start..end keeps snapshots (multiples of SNAPSHOT_INTERVAL in
    (start, end], ascending): its last; the last before `turn` (where the prompt's last message
    begins: a new question about the same system prompt, document or image resumes there); and
    every SNAPSHOT_EVERY positions (a prompt sharing only part of a long document)."""
    def floor(n: int) -> int:
        return n // SNAPSHOT_INTERVAL * SNAPSHOT_INTERVAL

    points = {floor(end), *range((start // SNAPSHOT_EVERY + 1) * SNAPSHOT_EVERY, end + 1, SNAPSHOT_EVERY)}
    if turn is not None:
        points.add(floor(turn))
    return sorted(p for p in points if start < p <= end)
