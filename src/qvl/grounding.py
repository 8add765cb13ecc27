"""Grounding answers -> boxes and points in the image's own pixels, and drawn on it.

Qwen3-VL answers a grounding prompt with JSON: `[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]`
and `[{"point_2d": [x, y], "label": ...}]`, coordinates relative to the image, 0-1000 on each
axis whatever its size. The answer is read tolerantly (code fences, text around it, a list cut
off half-way, single quotes are not JSON and are skipped): every complete object with a box or
a point counts; an answer with none gives empty lists, never an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

SCALE = 1000  # Qwen3-VL's relative coordinates run 0..1000 on both axes


@dataclass(frozen=True)
class Box:
    x1: float
    y1: float
    x2: float
    y2: float
    label: str = ""

    def to_dict(self) -> dict:
        return {"bbox_2d": [self.x1, self.y1, self.x2, self.y2], "label": self.label}


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    label: str = ""

    def to_dict(self) -> dict:
        return {"point_2d": [self.x, self.y], "label": self.label}


def parse(text: str) -> tuple[list[Box], list[Point]]:
    """Every JSON object in `text` with a `bbox_2d` (4 numbers) or `point_2d` (2 numbers), in
    order, coordinates as the model wrote them (relative, 0-1000)."""
    boxes, points = [], []
    for obj in _objects(text):
        label = obj.get("label")
        label = label if isinstance(label, str) else "" if label is None else json.dumps(label, ensure_ascii=False)
        box, point = obj.get("bbox_2d"), obj.get("point_2d")
        if _numbers(box, 4):
            x1, y1, x2, y2 = (float(v) for v in box)
            boxes.append(Box(min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2), label))
        elif _numbers(point, 2):
            points.append(Point(float(point[0]), float(point[1]), label))
    return boxes, points


def _numbers(value, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))


def _objects(text: str):
    """The JSON objects of `text` that hold a box or a point: each `{` is tried as the start of
    an object; one with a box or a point is taken whole, any other is searched inside."""
    decoder = json.JSONDecoder()
    i = 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(obj, dict):
            if "bbox_2d" in obj or "point_2d" in obj:
                yield obj
                i = end
                continue
        i += 1


def to_pixels(boxes: list[Box], points: list[Point], width: int, height: int) -> tuple[list[Box], list[Point]]:
    """Relative 0-1000 coordinates -> whole pixels of a width x height image (the image as it
    is shown: EXIF orientation applied), rounded half up and clamped to the image."""

    def px(v: float, side: int) -> int:
        v = min(max(v, 0.0), SCALE)  # first: a huge coordinate times the side would overflow to inf
        return min(math.floor(v * side / SCALE + 0.5), side)

    return ([Box(px(b.x1, width), px(b.y1, height), px(b.x2, width), px(b.y2, height), b.label) for b in boxes],
            [Point(px(p.x, width), px(p.y, height), p.label) for p in points])


def grounding(text: str, size: tuple[int, int] | None) -> dict:
    """{"boxes": [...], "points": [...]} of an answer, in the pixels of an image of `size`
    (width, height), or as written (0-1000) when there is no image to place them on."""
    boxes, points = parse(text)
    if size is not None:
        boxes, points = to_pixels(boxes, points, *size)
    return {"boxes": [b.to_dict() for b in boxes], "points": [p.to_dict() for p in points]}


PALETTE = ((230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240),
           (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128))


def draw(image, found: dict):
    """A copy of `image` (PIL, as shown) with the boxes and points of `found` (pixels, as
    `grounding` returns them) drawn and labelled; one colour per label."""
    from PIL import ImageDraw, ImageFont

    out = image.convert("RGB")
    pen = ImageDraw.Draw(out)
    width = max(2, round(min(out.size) / 250))
    font = ImageFont.load_default(size=max(12, round(min(out.size) / 40)))
    colours: dict[str, tuple] = {}

    def colour(label: str) -> tuple:
        return colours.setdefault(label, PALETTE[len(colours) % len(PALETTE)])

    def tag(x: float, y: float, label: str, fill: tuple) -> None:
        if not label:
            return
        left, top, right, bottom = pen.textbbox((x, y), label, font=font)
        top_y = y - (bottom - top) - 2 * width if y - (bottom - top) - 2 * width >= 0 else y
        shift = top_y - top
        pen.rectangle((left - width, top + shift - width, right + width, bottom + shift + width), fill=fill)
        pen.text((x, y + shift), label, fill=(255, 255, 255), font=font)

    for box in found["boxes"]:
        (x1, y1, x2, y2), label = box["bbox_2d"], box["label"]
        pen.rectangle((x1, y1, x2, y2), outline=colour(label), width=width)
        tag(x1, y1, label, colour(label))
    for point in found["points"]:
        (x, y), label = point["point_2d"], point["label"]
        r = 3 * width
        pen.ellipse((x - r, y - r, x + r, y + r), fill=colour(label), outline=(255, 255, 255), width=max(1, width // 2))
        tag(x + r, y - r, label, colour(label))
    return out
