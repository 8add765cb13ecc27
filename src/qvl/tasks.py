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
    subject: str | None = None  # what the user's text names, filled into the prompt's {} (detect: categories)
    grounding: bool = False  # the answer holds boxes or points to read out

    def prompt_for(self, text: str | None) -> str:
        """The task's prompt; a task with a subject needs the user's text for it."""
        if self.subject is None:
            return self.prompt
        if not text or not text.strip():
            raise ValueError(f"--task {self.name} needs the {self.subject}, e.g. qvl ask -i photo.jpg --task "
                             f"{self.name} \"cats, bicycles\"")
        return self.prompt.format(text.strip())


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
    # Qwen's document-parsing prompts: the page as Markdown (tables as tables) or as HTML.
    "markdown": Task("markdown", "qwenvl markdown", greedy=True, description="the document as Markdown",
                     max_image_tokens=1024),
    "html": Task("html", "qwenvl html", greedy=True, description="the document as HTML", max_image_tokens=1024),
    # The official detection prompt; the point prompt says the same of points.
    "detect": Task("detect", "Locate every instance that belongs to the following categories: '{}'. "
                   "Report bbox coordinates in JSON format.", greedy=True, description="find things: boxes",
                   subject="categories", grounding=True),
    "point": Task("point", "Locate every instance that belongs to the following categories: '{}'. "
                  "Report point coordinates in JSON format.", greedy=True, description="find things: points",
                  subject="categories", grounding=True),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}' (choose from: {', '.join(TASKS)})")
    return TASKS[name]
