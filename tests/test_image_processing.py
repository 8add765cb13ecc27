"""Image decoding and preprocessing: parity with transformers' Qwen2VLImageProcessorPil."""

from __future__ import annotations

import io
import json
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, features

from qvl.processing.image import (
    ImageError,
    ImageProcessorConfig,
    load_image,
    max_pixels_for_tokens,
    preprocess,
    smart_resize,
)

# Qwen3-VL-2B preprocessor_config.json
OFFICIAL = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
CFG = ImageProcessorConfig.from_dict(OFFICIAL)


def noise(height: int, width: int, seed: int = 0, channels: int = 3) -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = (height, width, channels) if channels > 1 else (height, width)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


def encode(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def reference():
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return mod.Qwen2VLImageProcessorPil(**OFFICIAL)


def reference_smart_resize():
    return pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl").smart_resize


def assert_parity(reference, img, min_pixels=None, max_pixels=None):
    lo = CFG.min_pixels if min_pixels is None else min_pixels
    hi = CFG.max_pixels if max_pixels is None else max_pixels
    want = reference(images=[img], size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="pt")
    got = preprocess(img, CFG, min_pixels=min_pixels, max_pixels=max_pixels)
    assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist())
    assert got.pixel_values.dtype == torch.float32
    assert got.pixel_values.shape == want["pixel_values"].shape
    torch.testing.assert_close(got.pixel_values, want["pixel_values"], atol=1e-5, rtol=0)
    assert torch.equal(got.pixel_values, want["pixel_values"])  # in practice bit-exact
    t, h, w = got.grid_thw
    assert got.size == (h * CFG.patch_size, w * CFG.patch_size)
    assert got.num_tokens == t * h * w // CFG.merge_size**2
    return got


# ---------------------------------------------------------------------------------------------
# Parity with the reference processor

SMALL_MAX = 64 * 32 * 32  # 64 LLM tokens: keeps "over the maximum" cases fast


@pytest.mark.parametrize(
    "height, width, min_pixels, max_pixels",
    [
        (33, 33, None, None),  # upscaled to the 65536 minimum
        (10, 500, None, None),  # rounds to a zero side first, rescued by the minimum
        (1, 150, None, None),  # one pixel high
        (64, 64, 1024, None),  # already a multiple of the factor: no size change
        (200, 300, 1024, None),  # non-square, rounded
        (301, 157, 1024, None),
        (500, 700, 1024, SMALL_MAX),  # over the maximum
        (1000, 1500, None, 4 * SMALL_MAX),  # over the maximum, max below default min
        (20, 3000, None, None),  # aspect 150
        (3000, 20, 1024, SMALL_MAX),  # aspect 150, tall, narrow side clamped to one factor
        (17, 3000, 1024, SMALL_MAX),  # aspect ~176
        (96, 96, 32 * 32, 32 * 32),  # tiny budget: one LLM token
    ],
)
def test_parity_sizes(reference, height, width, min_pixels, max_pixels):
    assert_parity(reference, noise(height, width, seed=height * 7 + width), min_pixels, max_pixels)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    height=st.integers(1, 400),
    width=st.integers(1, 400),
    tokens=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_parity_random_sizes(reference, height, width, tokens, seed):
    if max(height, width) / min(height, width) > 200:
        return
    assert_parity(reference, noise(height, width, seed), 1024, max_pixels_for_tokens(tokens, CFG))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "1"])
def test_parity_non_rgb_inputs(reference, mode):
    rgba = noise(40, 70, seed=3, channels=4)
    img = rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(16)
    if mode == "P":
        img.info["transparency"] = 2
    assert_parity(reference, img, 1024, SMALL_MAX)


def test_patch_layout():
    """Patch n covers merge block n // 4, position n % 4 inside it; frame repeated over T."""
    cfg = ImageProcessorConfig.from_dict({**OFFICIAL, "size": {"shortest_edge": 1024, "longest_edge": 10**7}})
    img = noise(64, 96, seed=5)
    out = preprocess(img, cfg)
    assert out.grid_thw == (1, 4, 6) and out.pixel_values.shape == (24, 1536)
    assert out.pixels.dtype == np.uint8 and out.pixels.nbytes * 8 == out.pixel_values.nbytes  # what a queue holds
    x = (torch.from_numpy(np.array(img)).double() / 255).float()  # [H, W, 3]
    x = ((x - 0.5) / 0.5).permute(2, 0, 1)  # [3, H, W]
    p = out.pixel_values.view(24, 3, 2, 16, 16)
    assert torch.equal(p[:, :, 0], p[:, :, 1])
    for n, (block_row, block_col, r, c) in enumerate(
        (br, bc, r, c) for br in range(2) for bc in range(3) for r in range(2) for c in range(2)
    ):
        row, col = (block_row * 2 + r) * 16, (block_col * 2 + c) * 16
        assert torch.equal(p[n, :, 0], x[:, row : row + 16, col : col + 16])


# ---------------------------------------------------------------------------------------------
# smart_resize properties

sizes = st.integers(1, 50_000)
factors = st.sampled_from([14, 28, 32])
budgets = st.integers(1, 20_000_000)


@settings(max_examples=300, deadline=None)
@given(height=sizes, width=sizes, factor=factors, a=budgets, b=budgets)
def test_smart_resize_equals_reference(height, width, factor, a, b):
    ref = reference_smart_resize()
    lo, hi = min(a, b), max(a, b)
    try:
        want = ref(height, width, factor=factor, min_pixels=lo, max_pixels=hi)
    except ValueError:
        with pytest.raises(ImageError, match="aspect ratio"):
            smart_resize(height, width, factor, lo, hi)
        return
    assert smart_resize(height, width, factor, lo, hi) == want


def aspect_ok(height: int, width: int) -> bool:
    return max(height, width) / min(height, width) <= 200


@settings(max_examples=300, deadline=None)
@given(height=sizes, width=sizes, factor=factors, a=budgets, b=budgets)
def test_smart_resize_guarantees(height, width, factor, a, b):
    if not aspect_ok(height, width):
        return
    lo, hi = min(a, b), max(a, b)
    h, w = smart_resize(height, width, factor, lo, hi)
    # Always: positive multiples of the factor.
    assert h >= factor and w >= factor and h % factor == 0 and w % factor == 0
    # Aspect kept: for one scale s (no resize, scale down to max, scale up to min) every side is
    # within one factor of s * side.
    scales = [1.0, math.sqrt(hi / (height * width)), math.sqrt(lo / (height * width))]
    assert any(abs(h - s * height) <= factor + 1e-6 and abs(w - s * width) <= factor + 1e-6 for s in scales)
    # Area inside [min, max] when the budget leaves room for rounding one factor per side
    # (the reference may overshoot max by clamping a side to one factor, or undershoot min
    # when max is close to min).
    aspect = max(height, width) / min(height, width)
    if math.sqrt(hi) >= math.sqrt(lo) + 2.5 * factor * math.sqrt(aspect):
        assert lo <= h * w <= hi
    elif math.sqrt(hi) >= math.sqrt(lo) + 1.1 * factor * math.sqrt(aspect):
        assert h * w <= hi


@settings(max_examples=200, deadline=None)
@given(height=sizes, width=sizes)
def test_smart_resize_official_budget_always_in_range(height, width):
    if not aspect_ok(height, width):
        return
    h, w = smart_resize(height, width, CFG.factor, CFG.min_pixels, CFG.max_pixels)
    assert CFG.min_pixels <= h * w <= CFG.max_pixels


def test_smart_resize_refuses_extreme_aspect():
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 2001, 32, 65536, 16777216)
    assert smart_resize(10, 2000, 32, 65536, 16777216)  # exactly 200 is allowed
    with pytest.raises(ImageError):
        smart_resize(0, 10, 32, 65536, 16777216)


def test_max_pixels_for_tokens():
    assert max_pixels_for_tokens(64, CFG) == 65536
    out = preprocess(noise(700, 900), CFG, max_pixels=max_pixels_for_tokens(64, CFG))
    assert out.num_tokens <= 64
    with pytest.raises(ValueError):
        max_pixels_for_tokens(0, CFG)


# ---------------------------------------------------------------------------------------------
# Config


def test_config_from_dict_official():
    assert CFG.factor == 32
    assert (CFG.min_pixels, CFG.max_pixels) == (65536, 16777216)
    assert CFG.image_mean == (0.5, 0.5, 0.5) and CFG.image_std == (0.5, 0.5, 0.5)


def test_config_legacy_keys_and_size_wins(tmp_path):
    legacy = {k: v for k, v in OFFICIAL.items() if k != "size"}
    cfg = ImageProcessorConfig.from_dict({**legacy, "min_pixels": 3136, "max_pixels": 1003520})
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 1003520)
    both = ImageProcessorConfig.from_dict({**OFFICIAL, "min_pixels": 3136, "max_pixels": 1003520})
    assert (both.min_pixels, both.max_pixels) == (65536, 16777216)
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(OFFICIAL))
    assert ImageProcessorConfig.from_file(path) == CFG


@pytest.mark.parametrize(
    "key, message",
    [
        ("patch_size", "'patch_size'"),
        ("merge_size", "'merge_size'"),
        ("temporal_patch_size", "'temporal_patch_size'"),
        ("image_mean", "'image_mean'"),
        ("size", "shortest_edge"),
    ],
)
def test_config_missing_key(key, message):
    d = {k: v for k, v in OFFICIAL.items() if k != key}
    with pytest.raises(ValueError, match=message):
        ImageProcessorConfig.from_dict(d)


def test_per_request_max_below_config_min_lowers_min():
    out = preprocess(noise(33, 33), CFG, max_pixels=4 * 32 * 32)
    assert out.size == (64, 64) and out.num_tokens == 4


# ---------------------------------------------------------------------------------------------
# Decoding


def test_exif_rotated_jpeg():
    stored = np.zeros((20, 40, 3), dtype=np.uint8)  # 40 wide, 20 high
    stored[:, :20] = (255, 0, 0)
    stored[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    img = load_image(encode(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes()))
    assert img.mode == "RGB" and img.size == (20, 40)
    top, bottom = np.asarray(img)[5, 10].astype(int), np.asarray(img)[35, 10].astype(int)
    assert top[0] > 200 and top[2] < 60  # red on top
    assert bottom[2] > 200 and bottom[0] < 60  # blue below


def test_rgba_transparent_becomes_white():
    a = np.zeros((4, 4, 4), dtype=np.uint8)
    a[..., :3] = (10, 20, 30)
    a[:2, :, 3] = 255  # top half opaque, bottom fully transparent
    for source in (encode(Image.fromarray(a, "RGBA")), Image.fromarray(a, "RGBA")):
        out = np.asarray(load_image(source))
        assert (out[:2] == (10, 20, 30)).all() and (out[2:] == 255).all()


def test_palette_with_transparency():
    img = Image.new("P", (4, 4), 0)
    img.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
    img.paste(1, (0, 0, 2, 4))
    img.info["transparency"] = 0
    out = np.asarray(load_image(encode(img)))
    assert (out[:, :2] == (200, 0, 0)).all() and (out[:, 2:] == 255).all()


def test_la_mode():
    a = np.zeros((2, 2, 2), dtype=np.uint8)
    a[0, :, 1] = 255  # row 0 opaque black, row 1 transparent
    out = np.asarray(load_image(encode(Image.fromarray(a, "LA"))))
    assert (out[0] == 0).all() and (out[1] == 255).all()


def test_cmyk_jpeg():
    img = load_image(encode(Image.new("CMYK", (8, 8), (255, 0, 0, 0)), "JPEG", quality=95))
    assert img.mode == "RGB"
    assert np.abs(np.asarray(img).astype(int) - (0, 255, 255)).max() <= 8


def test_16bit_png_scaled_not_clipped():
    values = np.array([[0, 65535, 128 * 257, 257]], dtype=np.uint16)
    data = encode(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    out = np.asarray(load_image(data))
    assert out.shape == (1, 4, 3)
    assert out[0, :, 0].tolist() == [0, 255, 128, 1]


def test_float_mode():
    img = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert np.asarray(load_image(img))[0, :, 0].tolist() == [0, 128, 255]


@pytest.mark.parametrize("mode", ["L", "1"])
def test_grayscale(mode):
    img = noise(5, 6, channels=1).convert(mode)
    out = np.asarray(load_image(encode(img)))
    assert out.shape == (5, 6, 3)
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()
    assert (out[..., 0] == np.asarray(img.convert("L"))).all()


def _animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    extra = {"lossless": True} if fmt == "WEBP" else {}
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **extra)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_first_frame(fmt):
    if fmt == "WEBP" and not features.check("webp"):
        pytest.skip("Pillow built without WebP")
    data = _animated(fmt)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3
    out = np.asarray(load_image(data)).astype(int)
    assert np.abs(out - (255, 0, 0)).max() <= 4


def test_not_an_image():
    with pytest.raises(ImageError, match="not a recognised image"):
        load_image(b"definitely not an image")


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="image file not found"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ImageError, match="image file not found"):
        load_image(str(tmp_path / "nope.png"))


def test_path_source(tmp_path):
    path = tmp_path / "x.png"
    noise(9, 11).save(path)
    assert load_image(path).size == (11, 9)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated(fmt):
    data = encode(noise(64, 64), fmt)
    with pytest.raises(ImageError):
        load_image(data[: len(data) // 2])


def png_declaring(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims width x height (pixel data stays 1x1)."""
    data = bytearray(encode(Image.new("RGB", (1, 1))))
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


def test_huge_header_refused_before_decoding():
    bomb = png_declaring(10_000, 10_000)  # 1e8 pixels declared, almost no data
    with pytest.raises(ImageError, match="exceeds the limit"):
        load_image(bomb, max_source_pixels=50_000_000)
    # With room in the limit the decoder runs and fails on the missing data: so the refusal
    # above happened before decoding.
    with pytest.raises(ImageError, match="could not decode"):
        load_image(bomb, max_source_pixels=200_000_000)
    with pytest.raises(ImageError, match="exceeds the limit"):
        load_image(encode(Image.new("RGB", (1, 1))), max_source_pixels=0)


def test_pillow_decompression_bomb_becomes_image_error():
    with pytest.raises(ImageError, match="decompression bomb"):
        load_image(png_declaring(30_000, 30_000), max_source_pixels=10**12)


# ---------------------------------------------------------------------------------------------
# Content hash


def test_hash_independent_of_source_encoding():
    img = noise(50, 70, seed=9)
    direct = preprocess(img, CFG)
    for fmt in ("PNG", "BMP", "TIFF"):
        decoded = preprocess(load_image(encode(img, fmt)), CFG)
        assert decoded.content_hash == direct.content_hash
        assert torch.equal(decoded.pixel_values, direct.pixel_values)


def test_hash_depends_on_pixels_and_size():
    img = noise(300, 400, seed=1)
    a = preprocess(img, CFG, max_pixels=max_pixels_for_tokens(64, CFG))
    b = preprocess(img, CFG, max_pixels=max_pixels_for_tokens(32, CFG))
    c = preprocess(img, CFG, max_pixels=max_pixels_for_tokens(64, CFG))
    assert a.size != b.size and a.content_hash != b.content_hash
    assert a.content_hash == c.content_hash
    assert preprocess(noise(300, 400, seed=2), CFG).content_hash != preprocess(img, CFG).content_hash
    other_norm = ImageProcessorConfig.from_dict({**OFFICIAL, "image_std": [0.25, 0.25, 0.25]})
    assert preprocess(img, other_norm).content_hash != preprocess(img, CFG).content_hash
