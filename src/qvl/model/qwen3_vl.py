"""The vision-language glue of Qwen3-VL and Qwen3.5/3.6: vision tower + text decoder +
lm_head, and the M-RoPE tables (over each head's rotary dims)."""

from __future__ import annotations

import torch
from torch import nn

from qvl.config import ModelConfig
from qvl.model.rope import inverse_frequencies, mrope_cos_sin
from qvl.model.text import TextModel
from qvl.model.vision import Grid, VisionModel


class Qwen3VL(nn.Module):
    """Attribute names follow the checkpoint (`visual`, `language_model`, `lm_head`). `mtp`
    holds a checkpoint's multi-token-prediction tensors as stored (Qwen3.5: unused by
    generation so far, kept for speculative decoding)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.visual = VisionModel(cfg.vision)
        self.language_model = TextModel(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq", inverse_frequencies(cfg.text.rotary_dim, cfg.text.rope_theta), persistent=False
        )
        self.mtp: dict[str, torch.Tensor] = {}

    def init_buffers(self) -> None:
        """Recompute the non-persistent RoPE tables (after building on the meta device)."""
        t, v = self.cfg.text, self.cfg.vision
        self.inv_freq = inverse_frequencies(t.rotary_dim, t.rope_theta)
        self.visual.inv_freq = inverse_frequencies(v.head_dim // 2, v.rope_theta)
        self.visual._grid_tables.clear()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.norm.weight.dtype

    def encode_images(self, patches: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches: [N, C*T*P*P] -> image embeddings [N/4, D] and DeepStack features."""
        return self.visual(patches, grids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, B, T] -> cos, sin [B, 1, T, rotary_dim] in the model dtype."""
        t = self.cfg.text
        return mrope_cos_sin(positions, self.inv_freq, t.mrope_section, t.mrope_interleaved, self.dtype)

    def embed(self, ids: torch.Tensor, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ids: [B, T] -> [B, T, D], image and video placeholder rows replaced by image_embeds [n, D]."""
        h = self.language_model.embed_tokens(ids)
        if image_embeds is not None and image_embeds.shape[0] > 0:
            h[self.cfg.is_vision_token(ids)] = image_embeds.to(h.dtype)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [B, T, D] -> [B, T, vocab] float32."""
        return self.lm_head(h).float()
