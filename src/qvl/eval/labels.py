"""A labelled set: a JSONL file (or a folder holding labels.jsonl), one item per line:

    {"id": "a1", "image": "a1.png", "question": "...", "answer": "...", "kind": "text"}

`image` (an image, or a PDF with `page`) or `video`, relative to the file's folder; `kind` is
text (the default), boxes or points; a boxes/points answer is the model's JSON text or the list
itself. Every problem is reported with its line, all at once, before any model loads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from qvl.batch.inputs import Item, kind_of
from qvl.grounding import parse
from qvl.options import UsageError

KINDS = ("text", "boxes", "points")
LABELS_FILE = "labels.jsonl"
SHOWN_PROBLEMS = 20


@dataclass(frozen=True)
class Label:
    item: Item  # what the engine answers: the media, its page, the question as the prompt
    answer: str  # the expected answer (boxes and points as JSON text)
    kind: str  # text | boxes | points
    line: int


def labels_path(source: str) -> Path:
    path = Path(source)
    if path.is_dir():
        path = path / LABELS_FILE
    if not path.is_file():
        raise UsageError(f"no labels at {path} (give a JSONL file, or a folder holding {LABELS_FILE})")
    return path


def read_labels(source: str) -> list[Label]:
    """Every labelled item of the file; UsageError listing each bad line (skipping none)."""
    path = labels_path(source)
    labels, problems, ids = [], [], {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                label = parse_row(line, number, path.parent)
            except ValueError as exc:
                problems.append(f"{path}:{number}: {exc}")
                continue
            if label.item.id in ids:
                problems.append(f"{path}:{number}: id {label.item.id!r} is already used on line {ids[label.item.id]}")
                continue
            ids[label.item.id] = number
            labels.append(label)
    if problems:
        more = f"\n... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        raise UsageError(f"{len(problems)} bad label line(s):\n" + "\n".join(problems[:SHOWN_PROBLEMS]) + more)
    if not labels:
        raise UsageError(f"{path} holds no labelled items")
    return labels


def parse_row(line: str, number: int, folder: Path) -> Label:
    """One line as a Label; ValueError saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("a label must be a JSON object")
    media = [key for key in ("image", "video") if key in row]
    if len(media) != 1 or not isinstance(row[media[0]], str) or not row[media[0]]:
        raise ValueError('needs an "image" (an image or a PDF) or a "video" path (a string), not both')
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError('needs a "question" (a non-empty string)')
    kind = row.get("kind", "text")
    if kind not in KINDS:
        raise ValueError(f'"kind" must be one of {", ".join(KINDS)}, not {kind!r}')
    answer = expected_answer(row.get("answer", None), kind, "answer" in row)
    path = row[media[0]] if os.path.isabs(row[media[0]]) else str(folder / row[media[0]])
    if not os.path.isfile(path):
        raise ValueError(f"{media[0]} file not found: {path}")
    page = row.get("page")
    if page is not None and (not isinstance(page, int) or isinstance(page, bool) or page < 1):
        raise ValueError('"page" must be a whole number from 1')
    item_kind = "video" if media[0] == "video" else kind_of(path)
    if page is not None and item_kind != "pdf":
        raise ValueError('"page" is for a PDF\'s pages')
    item_id = str(row["id"]) if row.get("id") is not None else f"line-{number}"
    return Label(Item(item_id, path, question, item_kind, page), answer, kind, number)


def expected_answer(answer, kind: str, given: bool) -> str:
    """The expected answer as text; boxes and points must hold what their kind says."""
    if not given:
        raise ValueError('needs an "answer"')
    if kind == "text":
        if not isinstance(answer, str):
            raise ValueError('a text "answer" must be a string')
        return answer
    if isinstance(answer, list):
        answer = json.dumps(answer, ensure_ascii=False)
    if not isinstance(answer, str):
        raise ValueError(f'a {kind} "answer" must be the JSON text or the list of objects')
    boxes, points = parse(answer)
    found = boxes if kind == "boxes" else points
    if not found and answer.strip() != "[]":
        key = "bbox_2d" if kind == "boxes" else "point_2d"
        raise ValueError(f'the {kind} "answer" holds no {key} (write [] for none)')
    return answer
