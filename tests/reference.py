"""Helpers that run the transformers reference on qvl's own inputs (tests only)."""

from __future__ import annotations

import torch


def load_reference(path):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def reference_inputs(parsed, image_token_id: int) -> dict:
    """transformers' forward/generate kwargs for a qvl ParsedRequest."""
    ids = parsed.ids[None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": (ids == image_token_id).int()}
    if parsed.images:
        kwargs["pixel_values"] = torch.cat([im.pixel_values for im in parsed.images])
        kwargs["image_grid_thw"] = torch.tensor([im.grid_thw for im in parsed.images])
    return kwargs
