"""The synthetic tasks, drawn from a seed: reading rendered text, finding shapes (boxes and
points in Qwen3-VL's 0-1000 answer format) and simple questions (colour, count). Item i of
seed s is the same on every machine (its own random stream; fonts from pinned packages), so a
training run and an evaluation set can be drawn independently from the same generator.

`write_set` writes the images and a `labels.jsonl` in `qvl eval`'s format."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from qvl.grounding import SCALE
from qvl.tasks import TASKS

READ_SIZE = (384, 32)  # width, height of a text strip: one row of 12 image tokens
CELL = 32  # a text strip's character cells: one image token wide
SCENE_SIZE = (192, 192)  # a picture of shapes: 6 x 6 image tokens

# (package, file in it): Latin fonts in several styles, and one that has Chinese
LATIN_FONTS = (("fontpkg_noto_sans", "files/NotoSans[wdth,wght].ttf"),
               ("fontpkg_noto_sans", "files/NotoSans-Italic[wdth,wght].ttf"),
               ("fontpkg_noto_serif", "files/NotoSerif[wdth,wght].ttf"),
               ("fontpkg_noto_serif", "files/NotoSerif-Italic[wdth,wght].ttf"),
               ("fontpkg_ibm_plex_mono", "files/IBMPlexMono-Regular.ttf"),
               ("fontpkg_ibm_plex_mono", "files/IBMPlexMono-Bold.ttf"),
               (None, "Aileron"))  # Pillow's own
CJK_FONT = ("cvttf_NotoSansCJK_Regular", "NotoSansCJKtc-Regular.otf")
FONT_PACKAGES = "fontpkg-noto-sans, fontpkg-noto-serif, fontpkg-ibm-plex-mono and cvttf-notosanscjk-regular"

# the 50 most frequent Chinese characters: enough examples of each for the small model's budget
HANZI = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后"
CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20),
           "orange": (245, 130, 20), "purple": (140, 40, 170), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
TASK_NAMES = ("read", "detect", "point", "ask")
MIX = {"read": 0.65, "detect": 0.15, "point": 0.05, "ask": 0.15}  # the tasks of a set drawn without --task


@dataclass(frozen=True)
class Sample:
    image: Image.Image
    question: str
    answer: str
    kind: str  # how `qvl eval` scores it: text, boxes or points
    task: str
    marks: tuple = ()  # where the answer is drawn: (character, x centre) per character, or the Shapes


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    box: tuple[int, int, int, int]  # pixels, x1 y1 x2 y2

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


# -- fonts ------------------------------------------------------------------------------------

def font_file(package: str, name: str) -> str:
    """The path of a font shipped in a package; an error naming what to install if it is missing."""
    try:
        path = resources.files(package) / name
    except ModuleNotFoundError:
        raise RuntimeError(f"the demo data needs fonts from the package {package} (pip install 'qvl[demo]': "
                           f"{FONT_PACKAGES})") from None
    return str(path)


@lru_cache(maxsize=256)
def font(which: tuple[str | None, str], size: int) -> ImageFont.FreeTypeFont:
    package, name = which
    return ImageFont.load_default(size) if package is None else ImageFont.truetype(font_file(package, name), size)


@lru_cache(maxsize=1024)
def has_glyph(which: tuple[str | None, str], char: str) -> bool:
    """Whether the font draws `char` as itself, not as its missing-glyph box (Pillow's Aileron
    has no euro, pound or yen sign: a price in it would be unreadable)."""
    face = font(which, 24)
    return bytes(face.getmask(char)) != bytes(face.getmask("\ue000"))  # a private-use code: never drawn


# -- reading ----------------------------------------------------------------------------------

def word(rng: random.Random) -> str:
    n = rng.randint(2, 5)
    text = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(n))[: rng.randint(4, 10)]
    return text.capitalize() if rng.random() < 0.4 else text.upper() if rng.random() < 0.2 else text


def number(rng: random.Random) -> str:
    digits = rng.randint(4, 9)
    value = rng.randint(10 ** (digits - 1), 10**digits - 1)
    return f"{value:,}" if rng.random() < 0.4 else str(value)


def price(rng: random.Random) -> str:
    value = f"{rng.randint(1, 99999)}.{rng.randint(0, 99):02d}"
    return rng.choice(("$", "€", "£", "¥")) + value if rng.random() < 0.7 else f"{value} {rng.choice(('EUR', 'USD'))}"


def date(rng: random.Random) -> str:
    y, m, d = rng.randint(1990, 2039), rng.randint(1, 12), rng.randint(1, 28)
    return rng.choice((f"{y}-{m:02d}-{d:02d}", f"{d:02d}/{m:02d}/{y}", f"{MONTHS[m - 1]} {d}, {y}", f"{d}.{m}.{y}"))


def code(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(rng.randint(4, 10)))


def hanzi(rng: random.Random) -> str:
    return "".join(rng.choice(HANZI) for _ in range(rng.randint(2, 6)))


READ_KINDS: dict[str, Callable[[random.Random], str]] = {
    "word": word, "number": number, "price": price, "date": date, "code": code, "hanzi": hanzi}


def read_item(rng: random.Random) -> Sample:
    """A text strip: one string of 4-12 characters (2-6 Chinese ones) in one of the fonts that draw
    all of them, at 18-26 pixels (Chinese 22-28), dark on light or light on dark, slightly rotated
    and noisy; letter-spaced: each character centred (give or take a few pixels) in its own
    CELL-wide cell, the width of one image token, from a random cell on. The strip is one image
    token high, so each token holds a whole character (in a strip of two rows each would hold half
    of one: the small model's tower learns that several times slower). The small demo model reads
    such text; normally spaced text, whose characters fall anywhere across the tokens, takes far
    more training than its budget."""
    kind = rng.choices(list(READ_KINDS), weights=(3, 2, 2, 2, 2, 2))[0]
    text = READ_KINDS[kind](rng)
    which = CJK_FONT if kind == "hanzi" else rng.choice([f for f in LATIN_FONTS if all(has_glyph(f, c) for c in text)])
    width, height = READ_SIZE
    ink, paper = _ink_and_paper(rng)
    face = font(which, rng.randint(22, 28) if kind == "hanzi" else rng.randint(18, 26))
    image = Image.new("RGB", READ_SIZE, paper)
    pen = ImageDraw.Draw(image)
    first = rng.randint(0, width // CELL - len(text))
    y = height / 2 + rng.uniform(-2, 2)
    marks = []
    for i, char in enumerate(text):
        x = (first + i + 0.5) * CELL + rng.uniform(-2, 2)
        pen.text((x, y), char, fill=ink, font=face, anchor="mm")
        marks.append((char, x))
    image = image.rotate(rng.uniform(-1, 1), resample=Image.Resampling.BICUBIC, fillcolor=paper)
    return Sample(_noisy(image, rng), TASKS["ocr"].prompt, text, "text", "read", tuple(marks))


def _ink_and_paper(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    dark = tuple(rng.randint(0, 90) for _ in range(3))
    light = tuple(rng.randint(190, 255) for _ in range(3))
    return (light, dark) if rng.random() < 0.15 else (dark, light)


def _noisy(image: Image.Image, rng: random.Random) -> Image.Image:
    """Light Gaussian noise (sigma 0-8) and sometimes a slight blur."""
    if rng.random() < 0.2:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.8)))
    sigma = rng.uniform(0, 8)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, sigma, (image.height, image.width, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8))


# -- shapes -----------------------------------------------------------------------------------

def scene(rng: random.Random, count: int) -> tuple[Image.Image, list[Shape]]:
    """`count` shapes (each 24-64 pixels, apart from each other) on a light background."""
    width, height = SCENE_SIZE
    paper = tuple(rng.randint(215, 255) for _ in range(3))
    image = Image.new("RGB", SCENE_SIZE, paper)
    pen = ImageDraw.Draw(image)
    shapes: list[Shape] = []
    while len(shapes) < count:
        side = rng.randint(24, 64)
        x, y = rng.randint(2, width - side - 2), rng.randint(2, height - side - 2)
        box = (x, y, x + side, y + side)
        if any(_overlap(box, s.box, margin=4) for s in shapes):
            continue
        shape = Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), box)
        _draw_shape(pen, shape)
        shapes.append(shape)
    return _noisy(image, rng), shapes


def _overlap(a: tuple[int, ...], b: tuple[int, ...], margin: int) -> bool:
    return a[0] < b[2] + margin and b[0] < a[2] + margin and a[1] < b[3] + margin and b[1] < a[3] + margin


def _draw_shape(pen: ImageDraw.ImageDraw, shape: Shape) -> None:
    x1, y1, x2, y2 = shape.box
    fill = COLOURS[shape.colour]
    if shape.kind == "circle":
        pen.ellipse((x1, y1, x2 - 1, y2 - 1), fill=fill)
    elif shape.kind == "square":
        pen.rectangle((x1, y1, x2 - 1, y2 - 1), fill=fill)
    else:
        pen.polygon([((x1 + x2) / 2, y1), (x2 - 1, y2 - 1), (x1, y2 - 1)], fill=fill)


def relative(v: float, side: int) -> int:
    """A pixel position as the answers write it: 0-1000 across the picture's side."""
    return round(v * SCALE / side)


def coordinates(shape: Shape) -> tuple[int, ...]:
    """The numbers the answers write for a shape in a scene: its box x1 y1 x2 y2, then its
    centre x y (the point)."""
    (x1, y1, x2, y2), (width, height) = shape.box, SCENE_SIZE
    return (relative(x1, width), relative(y1, height), relative(x2, width), relative(y2, height),
            relative((x1 + x2) / 2, width), relative((y1 + y2) / 2, height))


def _query(rng: random.Random, shapes: list[Shape]) -> tuple[str, list[Shape]]:
    """A category that names some of the shapes ("red square" or "circle") and those shapes in
    reading order (top to bottom, then left to right)."""
    target = rng.choice(shapes)
    name = target.name if rng.random() < 0.6 else target.kind
    found = [s for s in shapes if name in (s.name, s.kind)]
    return name, sorted(found, key=lambda s: (s.box[1], s.box[0]))


def named_shapes(question: str, shapes: list[Shape]) -> list[Shape]:
    """The shapes a scene question is about: every shape of the colour and kind it names ("red
    square"), else every one of the kind it names ("circle", "squares"); [] when it names none."""
    for shape in shapes:
        if shape.name in question:
            return [s for s in shapes if s.name == shape.name]
    kind = next((k for k in SHAPES if k in question), None)
    return [s for s in shapes if s.kind == kind]


def detect_question(rng: random.Random, shapes: list[Shape]) -> tuple[str, str]:
    name, found = _query(rng, shapes)
    answer = [{"bbox_2d": list(coordinates(s)[:4]), "label": name} for s in found]
    return TASKS["detect"].prompt_for(name), json.dumps(answer)


def point_question(rng: random.Random, shapes: list[Shape]) -> tuple[str, str]:
    name, found = _query(rng, shapes)
    answer = [{"point_2d": list(coordinates(s)[4:]), "label": name} for s in found]
    return TASKS["point"].prompt_for(name), json.dumps(answer)


def colour_question(rng: random.Random, shapes: list[Shape]) -> tuple[str, str] | None:
    """About a shape that is the only one of its kind (None when there is none)."""
    only = [s for s in shapes if sum(t.kind == s.kind for t in shapes) == 1]
    if not only:
        return None
    target = rng.choice(only)
    return f"What colour is the {target.kind}? Answer with one word.", target.colour


def count_question(rng: random.Random, shapes: list[Shape]) -> tuple[str, str]:
    kind = rng.choice(SHAPES)
    return f"How many {kind}s are there? Answer with a number.", str(sum(s.kind == kind for s in shapes))


def detect_item(rng: random.Random) -> Sample:
    image, shapes = scene(rng, rng.randint(1, 4))
    return Sample(image, *detect_question(rng, shapes), "boxes", "detect", tuple(shapes))


def point_item(rng: random.Random) -> Sample:
    image, shapes = scene(rng, rng.randint(1, 4))
    return Sample(image, *point_question(rng, shapes), "points", "point", tuple(shapes))


def ask_item(rng: random.Random) -> Sample:
    """"What colour is the circle?" about a picture with one circle, or "How many squares are
    there?" (1-6), answered with one word or digit."""
    if rng.random() < 0.5:
        image, shapes = scene(rng, rng.randint(1, 4))
        if question := colour_question(rng, shapes):
            return Sample(image, *question, "text", "ask", tuple(shapes))
    image, shapes = scene(rng, rng.randint(1, 6))
    return Sample(image, *count_question(rng, shapes), "text", "ask", tuple(shapes))


def follow_ups(seed: int, index: int, item: Sample, count: int) -> list[tuple[str, str]]:
    """Up to `count` more (question, answer) turns about item `index`'s picture (a scene; a text
    strip has none), drawn from their own stream: more answers per picture for training."""
    if item.task == "read":
        return []
    rng = random.Random(f"qvl-demo-more:{seed}:{index}")
    shapes = list(item.marks)
    asked = [rng.choice((detect_question, point_question, colour_question, count_question))(rng, shapes)
             for _ in range(count)]
    return [q for q in asked if q is not None and q[0] != item.question]


MAKERS: dict[str, Callable[[random.Random], Sample]] = {
    "read": read_item, "detect": detect_item, "point": point_item, "ask": ask_item}


def sample(seed: int, index: int, task: str | None = None, mix: dict[str, float] = MIX) -> Sample:
    """Item `index` of the set drawn from `seed`: one of `task`, or of a task drawn by `mix`."""
    rng = random.Random(f"qvl-demo:{seed}:{index}")
    task = task or rng.choices(list(mix), weights=list(mix.values()))[0]
    if task not in MAKERS:
        raise ValueError(f"unknown task '{task}' (choose from: {', '.join(MAKERS)})")
    return MAKERS[task](rng)


def write_set(out: Path, seed: int, count: int, task: str | None = None) -> Path:
    """Items 0..count-1 of `seed` as PNG files and a labels.jsonl beside them (qvl eval's format:
    id, image, question, answer, kind; and the task)."""
    out.mkdir(parents=True, exist_ok=True)
    digits = max(5, len(str(count - 1)))
    with open(out / "labels.jsonl", "w", encoding="utf-8") as labels:
        for i in range(count):
            item = sample(seed, i, task)
            name = f"{item.task}-{seed}-{i:0{digits}d}.png"
            item.image.save(out / name)
            row = {"id": name[:-4], "image": name, "question": item.question, "answer": item.answer,
                   "kind": item.kind, "task": item.task}
            labels.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out / "labels.jsonl"

