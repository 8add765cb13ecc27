"""Helpers that run the transformers reference on qvl's own inputs (tests only)."""

from __future__ import annotations

import torch


def load_reference(path):
    """transformers' model for a checkpoint folder, by its model_type: Qwen3VL, Qwen3VLMoe,
    Qwen3_5 or Qwen3_5Moe."""
    import json
    from pathlib import Path

    import transformers

    classes = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
               "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return getattr(transformers, classes[model_type]).from_pretrained(path, dtype=torch.float32).eval()


def reference_inputs(parsed, image_token_id: int) -> dict:
    """transformers' forward/generate kwargs for a qvl ParsedRequest."""
    ids = parsed.ids[None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": (ids == image_token_id).int()}
    if parsed.images:
        kwargs["pixel_values"] = torch.cat([im.pixel_values for im in parsed.images])
        kwargs["image_grid_thw"] = torch.tensor([im.grid_thw for im in parsed.images])
    return kwargs


def reference_inputs_video(parsed, cfg) -> dict:
    """As reference_inputs, for prompts with videos: qvl's frame pairs become the reference's
    pixel_values_videos (one video grid of t pairs per clip would be equal; one per pair is
    what get_rope_index splits them into anyway)."""
    ids = parsed.ids[None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()}
    for name, grid_name, units in (("pixel_values", "image_grid_thw", [u for u in parsed.images if not u.video]),
                                   ("pixel_values_videos", "video_grid_thw", [u for u in parsed.images if u.video])):
        if units:
            kwargs[name] = torch.cat([u.pixel_values for u in units])
            kwargs[grid_name] = torch.tensor([u.grid_thw for u in units])
    return kwargs


class _TorchvisionShim:
    """The three calls of torchvision.transforms.v2.functional that transformers' video processor
    makes, done as torchvision does them on CPU (torchvision cannot be installed beside torch
    2.13): uint8 frames go straight to torch's antialiased interpolate, normalize is sub_ then
    div_ in float32."""

    import enum

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    @staticmethod
    def resize(image, size, interpolation, antialias=True):
        if tuple(image.shape[-2:]) == tuple(size):
            return image
        shape = image.shape
        flat = image.reshape(-1, *shape[-3:])
        out = torch.nn.functional.interpolate(flat, size=list(size), mode=interpolation.value, antialias=antialias,
                                              align_corners=False)
        return out.reshape(*shape[:-2], *out.shape[-2:])

    @staticmethod
    def normalize(tensor, mean, std, inplace=False):
        tensor = tensor if inplace else tensor.clone()
        mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub_(mean).div_(std)

    @staticmethod
    def grayscale_to_rgb(image):
        return image.expand(*image.shape[:-3], 3, *image.shape[-2:]) if image.shape[-3] == 1 else image


def reference_video_processor(**kwargs):
    """transformers' Qwen3VLVideoProcessor, runnable here through _TorchvisionShim."""
    import transformers.image_processing_backends as backends
    import transformers.image_utils as image_utils
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    backends.tvF = video_utils.tvF = _TorchvisionShim
    modes = _TorchvisionShim.InterpolationMode
    image_utils.pil_torch_interpolation_mapping.update({PILImageResampling.BICUBIC: modes.BICUBIC,
                                                        PILImageResampling.BILINEAR: modes.BILINEAR})
    backends.pil_torch_interpolation_mapping = image_utils.pil_torch_interpolation_mapping
    return Qwen3VLVideoProcessor(**kwargs)
