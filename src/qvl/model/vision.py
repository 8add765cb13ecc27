"""Qwen3-VL vision tower: patch embedding, interpolated learned position embeddings,
2-D RoPE, per-image attention, patch merger and DeepStack mergers. Pure torch."""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from qvl.config import VisionConfig
from qvl.kernels import ops
from qvl.model.rope import inverse_frequencies, vision_cos_sin

Grid = tuple[int, int, int]  # (t, h, w) in patches
GRID_TABLES_BYTES = 128 << 20  # per-grid tables kept (least recent evicted): ~50 grids of 256 tokens, ~6 full-budget


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride is a matmul over flattened patches; the parameter
    keeps the checkpoint's Conv3d shape [D, C, T, P, P]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, shape[1:], stride=shape[1:], bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # patches: [N, C*T*P*P] -> [N, D]
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    plan: str | None = None  # its attention kernel (qvl.kernels.plan), given at load; None: the dtype's

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
                norm: nn.LayerNorm) -> torch.Tensor:
        # x: [N, D]; cos/sin: [N, 1, head_dim]; lengths: patches per image (attention stays inside
        # each) -> x + attention(norm(x)), [N, D]
        n = x.shape[0]
        q, k, v = ops.norm_linear(norm, self.qkv, x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, H, hd]
        out = ops.vision_attention(q, k, v, cos, sin, lengths, self.plan)
        return ops.residual_linear(self.proj, out.reshape(n, -1), x)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        # x: [N, D] -> x + mlp(norm(x))
        return ops.residual_linear(self.linear_fc2, ops.norm_linear(norm, self.linear_fc1, x, gelu_tanh=True), x)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attn(x, cos, sin, lengths, self.norm1)
        return self.mlp(x, self.norm2)


class PatchMerger(nn.Module):
    """Merges each 2x2 block of patches into one LLM token. The DeepStack mergers
    normalise after the shuffle (over 4*D), the final merger before it (over D)."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] (N patches in merge-block order) -> [N / merge^2, out_hidden]
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _block_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch in the processor's merge-block order: [h*w] each."""
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear, align_corners=True taps of a `side`-long table sampled at `size` points.
    index: [N] -> taps [N, 2] long, weights [N, 2] float32."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )
        self.register_buffer("inv_freq", inverse_frequencies(cfg.head_dim // 2, cfg.rope_theta), persistent=False)
        self._grid_tables: dict[Grid, tuple[torch.Tensor, ...]] = {}

    def grid_tables(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-grid constants, computed once per grid size: the interpolated position
        embeddings [N, hidden] (in the tower's dtype, as the reference rounds them) and the
        RoPE cos and sin [N, 1, head_dim]. The recently used grids' tables are kept, up to
        GRID_TABLES_BYTES; whoever changes the tower's weights or dtype clears them
        (Qwen3VL.init_buffers, as the loader does)."""
        tables = self._grid_tables.pop(grid, None)
        if tables is None:
            t, h, w = grid
            rows, cols = _block_order(h, w, self.cfg.spatial_merge_size)
            rt, rw = _axis_taps(rows, h, self.side)
            ct, cw = _axis_taps(cols, w, self.side)
            taps = (rt[:, :, None] * self.side + ct[:, None, :]).reshape(-1, 4)
            weights = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
            pos = (self.pos_embed(taps) * weights[..., None]).sum(1).to(self.patch_embed.proj.weight.dtype)
            cos, sin = vision_cos_sin(torch.stack([rows, cols], -1).repeat(t, 1), self.inv_freq)
            tables = (pos.repeat(t, 1), cos, sin)
        self._grid_tables[grid] = tables  # most recent last
        held = sum(x.nbytes for kept in self._grid_tables.values() for x in kept)
        while held > GRID_TABLES_BYTES and len(self._grid_tables) > 1:
            held -= sum(x.nbytes for x in self._grid_tables.pop(next(iter(self._grid_tables))))
        return tables

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches: [N, C*T*P*P] for all images, concatenated in order.
        Returns merged features [N / 4, out_hidden] and one [N / 4, out_hidden] per DeepStack layer."""
        return run_steps(self.steps(patches, grids))

    def steps(self, patches: torch.Tensor,
              grids: list[Grid]) -> Generator[None, None, tuple[torch.Tensor, list[torch.Tensor]]]:
        """`forward` one block at a time: yields after each block (the caller may do other
        work in between), returns what forward returns."""
        tables = [self.grid_tables(tuple(g)) for g in grids]
        pos, cos, sin = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*tables))
        lengths = [t * h * w for t, h, w in grids]
        x = self.patch_embed(patches) + pos
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in self.cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
            yield
        return self.merger(x), deepstack


def run_steps(steps: Generator):
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
