"""The vision probe: a training-only signal for the demo model's vision tower. Small heads read
what the merger hands the language model, one image token at a time, and are trained to say
what is drawn there, in the language model's own terms:
- on a text strip, the characters whose centres fall in the image token's column (up to SLOTS,
  left to right; an easy, dense target that teaches the tower to read), and for each answer
  token drawn there: that token and the one before it in the answer, as vectors scored against
  the tied token embeddings. An image token then carries "after <previous> comes <this>", which
  the language model can copy with one attention hop keyed on the token it has just written;
- on a scene, the shape covering the image token (or background), its box, whether its centre is
  there, its colour's word (again against the embeddings) and, where the recipe asks for them
  (`VisionProbe(digits=True)`), the hundreds and tens digits of each number the answers write
  for the shape (box and centre, 0-1000: a class of 10 each, so that the language model finds
  them as digits, not as a quantity it has to spell).
From scratch, the answer loss alone hardly reaches the vision tower (the language model first
learns the answers' prior and ignores the pictures); this dense, local signal makes the image
tokens informative, and readable, from the first steps. The heads are dropped when the
checkpoint is written.

Merged image tokens are in row-major order over the picture's (rows, columns) grid of merged
patches, one picture after another, as the merger emits them."""

from __future__ import annotations

import string

import torch
import torch.nn.functional as F

from qvl.demo.data import COLOURS, HANZI, SHAPES, Sample, coordinates

SLOTS = 3  # characters (or answer tokens) drawn in one image token's column, left to right
CHARACTERS = string.ascii_letters + string.digits + " ,.-/:$€£¥" + HANZI  # class k+1; 0 = none, last = other
CHARACTER_INDEX = {c: i + 1 for i, c in enumerate(CHARACTERS)}
OTHER = len(CHARACTERS) + 1
SHAPE_CLASSES = 1 + len(SHAPES) * len(COLOURS)  # 0 = background
NONE = -1  # an empty slot
NUMBERS = 6  # the numbers the answers write for a shape: its box x1 y1 x2 y2 and centre x y
DIGITS = 2  # of each (0-999): the hundreds and the tens, a class of 10 each


def token_centres(text: str, marks: tuple, pieces: list[bytes]) -> list[float]:
    """The x centre of each token (`pieces`: the tokens' bytes, which spell `text`): the mean of
    the centres of the characters it covers (a character split over tokens counts for each)."""
    ends = []  # the byte offset where each character ends
    for char in text:
        ends.append((ends[-1] if ends else 0) + len(char.encode("utf-8")))
    centres, offset = [], 0
    for piece in pieces:
        first = next(i for i, e in enumerate(ends) if e > offset)
        offset += len(piece)
        last = next(i for i, e in enumerate(ends) if e >= offset)
        centres.append(sum(x for _, x in marks[first:last + 1]) / (last - first + 1))
    return centres


def targets(item: Sample, grid_thw: tuple[int, int, int], answer: list[int], pieces: list[bytes], start: int,
            end: int, colour_ids: dict[str, int]) -> dict:
    """The probe's targets for one picture whose merged-token grid is grid_thw's rows and columns
    halved. A text strip: "characters" [tokens, SLOTS] (classes, 0 where empty), "current" and
    "previous" [tokens, SLOTS] token ids (NONE where empty)
    for the answer tokens `answer` (their bytes `pieces`; `start` is the token before the first,
    `end` follows the last, drawn one column right of it). A scene: "shape" [tokens], "box"
    [tokens, 4] (x1 y1 x2 y2 as fractions of the picture), "centre" [tokens] and "colour"
    [tokens] (the colour word's token id, NONE on the background), "digits" [tokens, NUMBERS * DIGITS]
    (the covering shape's, 0 on the background)."""
    rows, cols = grid_thw[1] // 2, grid_thw[2] // 2
    width, height = item.image.size
    if item.task == "read":
        characters = torch.zeros(cols, SLOTS, dtype=torch.long)
        for char, x in item.marks:
            col = min(cols - 1, max(0, int(x * cols / width)))
            free = (characters[col] == 0).nonzero()
            if len(free):
                characters[col, free[0, 0]] = CHARACTER_INDEX.get(char, OTHER)
        current = torch.full((cols, SLOTS), NONE)
        previous = torch.full((cols, SLOTS), NONE)
        columns = [min(cols - 1, max(0, int(x * cols / width))) for x in token_centres(item.answer, item.marks, pieces)]
        columns.append(min(cols - 1, columns[-1] + 1))
        filled = [0] * cols
        for token, before, col in zip([*answer, end], [start, *answer], columns):
            if filled[col] < SLOTS:
                current[col, filled[col]], previous[col, filled[col]] = token, before
                filled[col] += 1
        return {"characters": characters.repeat(rows, 1), "current": current.repeat(rows, 1),
                "previous": previous.repeat(rows, 1)}
    shape = torch.zeros(rows, cols, dtype=torch.long)
    colour = torch.full((rows, cols), NONE)
    box = torch.zeros(rows, cols, 4)
    digits = torch.zeros(rows, cols, NUMBERS * DIGITS, dtype=torch.long)
    centre = torch.zeros(rows, cols)
    cell_w, cell_h = width / cols, height / rows
    for r in range(rows):
        for c in range(cols):
            cell = (c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h)
            covering = max(item.marks, key=lambda s: _overlap(cell, s.box))
            if _overlap(cell, covering.box) > 0:
                shape[r, c] = 1 + SHAPES.index(covering.kind) * len(COLOURS) + list(COLOURS).index(covering.colour)
                colour[r, c] = colour_ids[covering.colour]
                x1, y1, x2, y2 = covering.box
                box[r, c] = torch.tensor([x1 / width, y1 / height, x2 / width, y2 / height])
                digits[r, c] = torch.tensor([v // 10 ** (2 - d) % 10 for v in coordinates(covering) for d in range(DIGITS)])
    for s in item.marks:
        cx, cy = (s.box[0] + s.box[2]) / 2, (s.box[1] + s.box[3]) / 2
        centre[min(rows - 1, int(cy / cell_h)), min(cols - 1, int(cx / cell_w))] = 1.0
    return {"shape": shape.flatten(), "colour": colour.flatten(), "box": box.reshape(-1, 4), "centre": centre.flatten(),
            "digits": digits.reshape(rows * cols, -1)}


def covered(size: tuple[int, int], grid_thw: tuple[int, int, int], shapes: list) -> torch.Tensor:
    """bool [merged tokens]: the image tokens of a picture of `size` (width, height) whose cell
    overlaps any of `shapes`, row-major as the merger emits them."""
    rows, cols = grid_thw[1] // 2, grid_thw[2] // 2
    cell_w, cell_h = size[0] / cols, size[1] / rows
    return torch.tensor([any(_overlap((c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h), s.box) > 0
                             for s in shapes) for r in range(rows) for c in range(cols)])


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def collate(probes: list[dict]) -> dict[str, torch.Tensor]:
    """One batch's targets, with the merged-token indices they apply to (pictures in order)."""
    read, scene = {"index": []}, {"index": []}
    start = 0
    for p in probes:
        tokens = len(next(iter(p.values())))
        group = read if "current" in p else scene
        group["index"].append(torch.arange(start, start + tokens))
        for name, value in p.items():
            group.setdefault(name, []).append(value)
        start += tokens
    return {f"{prefix}_{name}": torch.cat(values) for prefix, group in (("read", read), ("scene", scene))
            for name, values in group.items() if values}


class VisionProbe(torch.nn.Module):
    """Linear heads on the merged image tokens [N, hidden]; token predictions are vectors scored
    against the (tied) token embeddings."""

    def __init__(self, hidden: int, digits: bool = True):
        super().__init__()
        self.characters = torch.nn.Linear(hidden, SLOTS * (OTHER + 1))
        self.read = torch.nn.Linear(hidden, 2 * SLOTS * hidden)
        self.scene = torch.nn.Linear(hidden, SHAPE_CLASSES + 4 + 1 + hidden)
        self.digits = torch.nn.Linear(hidden, NUMBERS * DIGITS * 10) if digits else None

    def loss(self, tokens: torch.Tensor, batch: dict[str, torch.Tensor], table: torch.Tensor,
             vocabulary: torch.Tensor) -> torch.Tensor:
        """The probe's loss for the merged image tokens [N, hidden] of the batch's pictures; token
        ids are scored over `vocabulary` (sorted ids that include every target), whose token
        embeddings are `table` [V', hidden]."""
        loss = tokens.new_zeros(())
        if "read_index" in batch:
            strip = tokens[batch["read_index"]]
            loss = loss + F.cross_entropy(self.characters(strip).view(-1, OTHER + 1), batch["read_characters"].flatten())
            out = self.read(strip).view(-1, 2, SLOTS, tokens.shape[-1])
            for which, name in enumerate(("current", "previous")):
                target = batch[f"read_{name}"]  # [n, SLOTS]
                used = target != NONE
                logits = out[:, which][used] @ table.T
                loss = loss + F.cross_entropy(logits, torch.searchsorted(vocabulary, target[used]))
        if "scene_index" in batch:
            scene = tokens[batch["scene_index"]]
            out = self.scene(scene)  # [n, classes + 5 + hidden]
            loss = loss + F.cross_entropy(out[:, :SHAPE_CLASSES], batch["scene_shape"])
            on = batch["scene_shape"] > 0
            if on.any():
                box = out[on, SHAPE_CLASSES:SHAPE_CLASSES + 4]
                loss = loss + 10 * F.l1_loss(box, batch["scene_box"][on])
                if self.digits is not None:
                    digits = self.digits(scene[on]).view(-1, 10)
                    loss = loss + F.cross_entropy(digits, batch["scene_digits"][on].flatten())
                logits = out[on, SHAPE_CLASSES + 5:] @ table.T
                loss = loss + F.cross_entropy(logits, torch.searchsorted(vocabulary, batch["scene_colour"][on]))
            loss = loss + F.binary_cross_entropy_with_logits(out[:, SHAPE_CLASSES + 4], batch["scene_centre"])
        return loss

    @staticmethod
    def token_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every token id the batch's targets name."""
        ids = [batch[k].flatten() for k in ("read_current", "read_previous", "scene_colour")
               if k in batch]
        ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        return ids[ids != NONE]
