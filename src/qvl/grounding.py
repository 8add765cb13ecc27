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
import re
from dataclasses import dataclass
from json.decoder import scanstring

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
        label = label if isinstance(label, str) else "" if label is None else _written(label)
        box, point = obj.get("bbox_2d"), obj.get("point_2d")
        if _numbers(box, 4):
            x1, y1, x2, y2 = (float(v) for v in box)
            boxes.append(Box(min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2), label))
        elif _numbers(point, 2):
            points.append(Point(float(point[0]), float(point[1]), label))
    return boxes, points


def _written(value) -> str:
    """A label that is no string, as JSON text ("" if it nests too deeply to be written)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        return ""


def _numbers(value, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))


def _objects(text: str):
    """The JSON objects of `text` that hold a box or a point: each `{` is tried as the start of
    an object; one with a box or a point is taken whole, any other is searched inside. Linear
    in the text: a reading records every object it opens (whole, or broken where the JSON
    breaks), so only a `{` no reading has opened is read, one an earlier reading saw inside a
    string; that reading sees the quotes the other way round, so no character is read more than
    twice."""
    read: dict[int, tuple[dict, int] | None] = {}
    i = text.find("{")
    while i != -1:
        if i not in read:
            _read(text, i, read)
        found = read[i]
        if found is not None and ("bbox_2d" in found[0] or "point_2d" in found[0]):
            yield found[0]
            i = found[1]
        else:
            i += 1
        i = text.find("{", i)


_SPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?")  # as Python's json reads one
_WORDS = {"null": None, "true": True, "false": False, "NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _read(text: str, start: int, read: dict) -> None:
    """JSON from the `{` at `start`, as Python's json reads it but with a stack of its own
    (so any depth): into `read`, by position, every object opened, as (object, end) once it
    closes, None if the JSON breaks while it is open."""
    stack: list[tuple[int, dict | list, str | None]] = []  # open objects and arrays: (start, it, its key)
    key, i, expect = None, start, "value"  # expect "key?" / "value?": just opened, its closing bracket may come
    try:
        while True:
            i = _SPACE.match(text, i).end() if stack else i
            char = text[i: i + 1]
            container = stack[-1][1] if stack else None
            if expect in ("key", "key?") and char == '"':
                key, i = scanstring(text, i + 1)
                expect = "colon"
            elif expect == "colon" and char == ":":
                i, expect = i + 1, "value"
            elif expect == "next" and char == ",":
                i, expect = i + 1, "key" if isinstance(container, dict) else "value"
            elif expect in ("next", "key?", "value?") and char == ("}" if isinstance(container, dict) else "]"):
                at, done, key = stack.pop()
                i, expect = i + 1, "next"
                if isinstance(done, dict):
                    read[at] = (done, i)
                if not stack:
                    return
                _put(stack[-1][1], key, done)
            elif expect in ("value", "value?") and char in ("{", "["):
                stack.append((i, {} if char == "{" else [], key))
                i, expect = i + 1, "key?" if char == "{" else "value?"
            elif expect in ("value", "value?"):
                value, i = _scalar(text, i)
                _put(container, key, value)
                expect = "next"
            else:
                raise ValueError(f"unexpected {char!r} at {i}")
    except ValueError:  # broken JSON (a bad character, a cut, a number Python will not read)
        for at, container, _ in stack:
            if isinstance(container, dict):
                read[at] = None


def _put(container: dict | list, key: str | None, value) -> None:
    """Adds `value` to the open container (under `key` in an object)."""
    if isinstance(container, dict):
        container[key] = value
    else:
        container.append(value)


def _scalar(text: str, i: int):
    """(value, end) of the string, word or number at `i`; ValueError if none is there."""
    if text.startswith('"', i):
        return scanstring(text, i + 1)
    for word, value in _WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    number = _NUMBER.match(text, i)
    if number is None:
        raise ValueError(f"no JSON value at {i}")
    whole, fraction, exponent = number.groups()  # int() of more than 4300 digits: ValueError
    return float(number.group()) if fraction or exponent else int(whole), number.end()


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
