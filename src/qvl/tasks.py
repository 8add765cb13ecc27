"""Task presets shared by every front door (CLI, server, web page, batch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    greedy: bool  # OCR wants the single most likely reading, not a sample
    description: str
    max_image_tokens: int | None = None  # a budget of its own (small print needs detail), else the default


TASKS = {
    "describe": Task(
        "describe",
        "Describe this image in detail: the scene, the objects and people in it, and any text you can read.",
        greedy=False,
        description="describe the scene",
    ),
    "ocr": Task(
        "ocr",
        "Read all the text in this image, Chinese and English, line by line in reading order. "
        "Output only the text, one line per line of the image.",
        greedy=True,
        description="OCR, Chinese and English, line by line in reading order",
        max_image_tokens=1024,
    ),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}' (choose from: {', '.join(TASKS)})")
    return TASKS[name]
