"""Image decoding and Qwen3-VL preprocessing: decode -> RGB -> smart_resize -> normalise -> patches.

Numerically this matches transformers' `Qwen2VLImageProcessorPil` (the processor Qwen3-VL uses):
PIL bicubic resize on uint8 RGB, `x * (1/255)` in float64 then float32, `(x - mean) / std` in
float32, and the patch layout (merge block, C, T, patch row, patch col).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """Input that is not a usable image; message names the problem."""


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Settings from preprocessor_config.json that shape the pixels given to the vision tower."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"{name} must have 3 values, got {getattr(self, name)!r}")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"image_std must be non-zero, got {self.image_std!r}")

    @property
    def factor(self) -> int:
        """Side of one LLM token in pixels: resized sides are multiples of this."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict) -> ImageProcessorConfig:
        """Read preprocessor_config.json contents; `size` wins over legacy `min_pixels`/`max_pixels`."""

        def required(key: str):
            if key not in d:
                raise ValueError(f"preprocessor config is missing required key {key!r}")
            return d[key]

        size = d.get("size") or {}
        min_pixels = size.get("shortest_edge", d.get("min_pixels"))
        max_pixels = size.get("longest_edge", d.get("max_pixels"))
        if min_pixels is None:
            raise ValueError("preprocessor config is missing 'size.shortest_edge' (or 'min_pixels')")
        if max_pixels is None:
            raise ValueError("preprocessor config is missing 'size.longest_edge' (or 'max_pixels')")
        return cls(
            patch_size=required("patch_size"),
            temporal_patch_size=required("temporal_patch_size"),
            merge_size=required("merge_size"),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_mean=tuple(float(v) for v in required("image_mean")),
            image_std=tuple(float(v) for v in required("image_std")),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ImageProcessorConfig:
        """Read a preprocessor_config.json file."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


# ---------------------------------------------------------------------------------------------
# Decoding


def load_image(
    source: bytes | str | os.PathLike | Image.Image, *, max_source_pixels: int = 100_000_000
) -> Image.Image:
    """Decode an image to an RGB PIL image (EXIF orientation applied, first frame, alpha on white).

    The declared size is checked against `max_source_pixels` before any pixel is decoded.
    Pillow's own `DecompressionBombError` (above 2 * `Image.MAX_IMAGE_PIXELS`) still applies and
    becomes an ImageError; its warning is silenced because `max_source_pixels` is the limit we own.
    """
    if isinstance(source, Image.Image):
        _check_source_size(source.size, max_source_pixels)
        return _normalise(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        fp, name = io.BytesIO(bytes(source)), "image bytes"
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ImageError(f"image file not found: {path}")
        fp, name = path, str(path)
    else:
        raise ImageError(f"unsupported image source type: {type(source).__name__}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(fp) as img:
                _check_source_size(img.size, max_source_pixels)
                img.load()
                return _normalise(img)
        except ImageError:
            raise
        except Image.DecompressionBombError as e:
            raise ImageError(f"image refused as a decompression bomb: {e}") from e
        except Image.UnidentifiedImageError as e:
            raise ImageError(f"not a recognised image format: {name}") from e
        except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
            raise ImageError(f"could not decode image ({name}): {e}") from e


def _check_source_size(size: tuple[int, int], max_source_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has an empty size: {width}x{height}")
    if width * height > max_source_pixels:
        raise ImageError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{max_source_pixels} source pixels"
        )


def _normalise(img: Image.Image) -> Image.Image:
    """Apply EXIF orientation, then convert to RGB. Returns a new image (the source may be closed)."""
    try:
        oriented = ImageOps.exif_transpose(img)  # a transposed copy, or a plain copy
    except Exception:  # a broken EXIF block must not make an otherwise fine image unusable
        oriented = img.copy()
    return to_rgb(oriented)


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB; transparency is composited on white.

    16-bit and 32-bit integer modes ('I;16*', 'I') are read as 0..65535 and scaled to 0..255;
    float mode 'F' is read as 0..1 when all values lie there, else clipped to 0..255.
    (Pillow's own convert clips these at 255, which turns most 16-bit images white.)
    """
    if img.mode == "RGB" and img.info.get("transparency") is None:
        return img
    if img.mode.startswith("I") or img.mode == "F":
        img = _high_depth_to_l(img)
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    try:
        return img.convert("RGB")
    except ValueError as e:
        raise ImageError(f"unsupported image mode {img.mode!r}: {e}") from e


def _high_depth_to_l(img: Image.Image) -> Image.Image:
    """'I;16*' / 'I' / 'F' -> 'L' (or 'LA' when a transparent grey level is declared)."""
    values = np.asarray(img).astype(np.float64)  # [H, W]
    if img.mode == "F":
        finite = values[np.isfinite(values)]
        in_unit = finite.size == 0 or (finite.min() >= 0.0 and finite.max() <= 1.0)
        scaled = np.nan_to_num(values) * (255.0 if in_unit else 1.0)
    else:
        scaled = np.clip(values, 0, 65535) / 257.0
    grey = np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
    transparency = img.info.get("transparency")
    if isinstance(transparency, int):
        alpha = np.where(values == transparency, 0, 255).astype(np.uint8)
        return Image.fromarray(np.stack([grey, alpha], axis=-1), mode="LA")
    return Image.fromarray(grey, mode="L")


# ---------------------------------------------------------------------------------------------
# Resizing


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area near [min_pixels, max_pixels], aspect kept.

    Same arithmetic as transformers' `smart_resize`. Guarantees: both sides are positive multiples
    of `factor`; the area is <= max_pixels unless flooring to one `factor` forces a side up
    (max_pixels < factor**2 or very elongated images); the area is >= min_pixels.
    """
    if height <= 0 or width <= 0:
        raise ImageError(f"image size must be positive, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(
            f"image aspect ratio {ratio:.1f} ({width}x{height}) exceeds the maximum of {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def max_pixels_for_tokens(max_image_tokens: int, cfg: ImageProcessorConfig) -> int:
    """Pixel budget giving at most `max_image_tokens` LLM tokens (one token = factor x factor pixels)."""
    if max_image_tokens <= 0:
        raise ValueError(f"max_image_tokens must be positive, got {max_image_tokens}")
    return max_image_tokens * cfg.factor**2


# ---------------------------------------------------------------------------------------------
# Preprocessing


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One unit for the vision tower: a still image, or a pair of video frames (`video`).
    It keeps the resized uint8 pixels; the float32 patches (8x larger: normalised, a still
    repeated over T) are made when the tower runs, so requests waiting in a queue stay small."""

    pixels: np.ndarray  # [H, W, 3] uint8 resized (a still), or [T, H, W, 3] (a video's frame pair)
    cfg: ImageProcessorConfig
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches; t = 1 for a frame pair too
    num_tokens: int  # t*h*w // merge_size**2: LLM tokens for this unit
    content_hash: str  # sha256 hex of resized pixels + size + preprocessing settings
    size: tuple[int, int]  # resized (height, width)
    video: bool = False  # a frame pair: placed with <|video_pad|>, normalised as the video processor does
    shown_size: tuple[int, int] | None = None  # (width, height) of the image as decoded and oriented: boxes' pixels

    @property
    def pixel_values(self) -> torch.Tensor:
        """[N, C*T*P*P] float32, N = h*w patches (computed on each access)."""
        cfg = self.cfg
        frames = self.pixels if self.video else self.pixels[None]  # [F, H, W, 3]
        values = _normalise_pixels(frames, cfg, self.video)
        return patchify(values, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)


def preprocess(
    image: Image.Image,
    cfg: ImageProcessorConfig,
    *,
    max_pixels: int | None = None,
    min_pixels: int | None = None,
) -> ProcessedImage:
    """Resize, normalise and patchify one still image.

    `max_pixels`/`min_pixels` override the config per request (any positive value, also above
    cfg.max_pixels). When the effective max is below the effective min, the min is lowered to
    the max so the request's budget cap wins.
    """
    hi = cfg.max_pixels if max_pixels is None else max_pixels
    lo = cfg.min_pixels if min_pixels is None else min_pixels
    if hi <= 0 or lo <= 0:
        raise ValueError(f"pixel budgets must be positive, got min_pixels={lo}, max_pixels={hi}")
    lo = min(lo, hi)

    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, cfg.factor, lo, hi)
    resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(resized, dtype=np.uint8)  # [H, W, 3]

    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    return ProcessedImage(
        pixels=pixels,
        cfg=cfg,
        grid_thw=grid,
        num_tokens=grid[0] * grid[1] * grid[2] // cfg.merge_size**2,
        content_hash=content_hash(pixels, cfg),
        size=(height, width),
        shown_size=rgb.size,
    )


def _normalise_pixels(pixels: np.ndarray, cfg: ImageProcessorConfig, video: bool = False) -> torch.Tensor:
    """uint8 -> normalised float32 through an exact lookup table, as the reference computes it:
    ((x * (1/255) in float64 -> float32) - mean) / std for images (the PIL image processor),
    (x - 255 mean) / (255 std) in float32 for video frames (the torch video processor)."""
    # pixels: [F, H, W, 3] uint8 -> [F, 3, H, W] float32
    levels = torch.arange(256, dtype=torch.float32)
    if video:
        mean = torch.tensor(cfg.image_mean) * (1.0 / (1 / 255))
        std = torch.tensor(cfg.image_std) * (1.0 / (1 / 255))
        table = ((levels[None, :] - mean[:, None]) / std[:, None]).numpy()  # [3, 256]
    else:
        unit = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
        mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
        table = (unit[None, :] - mean) / std  # [3, 256] float32, same ops as the reference
    channels = np.arange(3)
    return torch.from_numpy(table[channels, pixels]).permute(0, 3, 1, 2)


def patchify(values: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """Cut frames into flattened patches, merge blocks contiguous; one frame (a still) is
    repeated over T, T frames (a video's pair) fill it."""
    # values: [F, C, H, W], F in (1, T) -> [gh*gw, C*T*P*P]
    f, c, h, w = values.shape
    p, m, t = patch_size, merge_size, temporal_patch_size
    gh, gw = h // p, w // p
    x = values.reshape(f, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(2, 5, 3, 6, 1, 0, 4, 7)  # [gh/m, gw/m, m, m, C, F, P, P]
    x = x.expand(gh // m, gw // m, m, m, c, t, p, p)
    return x.reshape(gh * gw, c * t * p * p).contiguous()


def content_hash(pixels: np.ndarray, cfg: ImageProcessorConfig, video: bool = False) -> str:
    """sha256 of the resized uint8 RGB pixels plus everything else that shapes pixel_values."""
    # pixels: [H, W, 3] uint8, or [T, H, W, 3] for a video's frame pair
    shape = "x".join(map(str, pixels.shape[:-1]))
    header = (
        f"qvl-{'video' if video else 'image'}-v1|{shape}|patch={cfg.patch_size}|merge={cfg.merge_size}"
        f"|temporal={cfg.temporal_patch_size}|mean={cfg.image_mean!r}|std={cfg.image_std!r}|"
    )
    digest = hashlib.sha256(header.encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    return digest.hexdigest()
