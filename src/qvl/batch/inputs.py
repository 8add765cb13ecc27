"""What to run: a folder (recursive), a glob or a JSONL file becomes a list of items whose
ids stay the same from one run to the next (resume matches rows to items by id)."""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from qvl.options import UsageError

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".wmv", ".flv"})
PDF_EXTENSIONS = frozenset({".pdf"})
JSONL_EXTENSIONS = frozenset({".jsonl", ".ndjson"})
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS | PDF_EXTENSIONS


@dataclass(frozen=True)
class Item:
    id: str
    path: str  # the image, video or PDF, as written to the output row (under the key `kind`)
    prompt: str | None = None  # None: the job's --prompt / --task
    kind: str = "image"  # image | video | pdf
    page: int | None = None  # a PDF's page (from 1): each page is an item of its own

    @property
    def source(self) -> str:
        """What the engine reads: the path, with its page for a PDF's page."""
        return f"{self.path}#pages={self.page}" if self.page is not None else self.path

    def fields(self) -> dict:
        """What an output row says of the item: {kind: path}, and the page of a PDF."""
        return {self.kind: self.path, **({"page": self.page} if self.kind == "pdf" else {})}


def kind_of(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    return "video" if suffix in VIDEO_EXTENSIONS else "pdf" if suffix in PDF_EXTENSIONS else "image"


def pages(item: Item) -> list[Item]:
    """A PDF item as one item per page (ids `<id>#page=N`); anything else as itself. A PDF
    whose pages cannot be counted stays one item, which fails with the reason as its row."""
    if item.kind != "pdf":
        return [item]
    from qvl.processing.pdf import PdfError, page_count

    try:
        count = page_count(item.path)
    except PdfError:
        return [item]
    return [Item(f"{item.id}#page={n}", item.path, item.prompt, "pdf", n) for n in range(1, count + 1)]


def read_items(source: str) -> list[Item]:
    """Items from a folder, a glob, a JSONL file or a single image, video or PDF (one item per
    page); fails on duplicate ids."""
    path = Path(source)
    if path.is_dir():
        items = _media_items(sorted(_media(path.rglob("*"))), path)
    elif path.is_file() and path.suffix.lower() in JSONL_EXTENSIONS:
        items = _jsonl_items(path)
    elif path.is_file():
        items = [Item(path.name, str(path), kind=kind_of(path))]
    elif glob.has_magic(source):
        items = _media_items(sorted(_media(map(Path, glob.glob(source, recursive=True)))), _glob_root(source))
    else:
        raise UsageError(f"INPUT not found: {source} (give a folder, a quoted glob or a .jsonl file)")
    if not items:
        raise UsageError(f"no images, videos or PDFs in {source} (extensions: "
                         f"{', '.join(sorted(MEDIA_EXTENSIONS))})")
    items = [page for item in items for page in pages(item)]
    _check_unique(items, source)
    return items


def _media(paths) -> list[Path]:
    return [p for p in paths if p.suffix.lower() in MEDIA_EXTENSIONS and p.is_file()]


def _media_items(paths: list[Path], root: Path) -> list[Item]:
    """Id = the path relative to the folder (or the glob's fixed leading folders), with '/'."""
    return [Item(Path(os.path.relpath(p, root)).as_posix(), str(p), kind=kind_of(p)) for p in paths]


def _glob_root(pattern: str) -> Path:
    """The leading folders of a glob that hold no wildcard: `scans/2024/*/p*.png` -> scans/2024."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _jsonl_items(path: Path) -> list[Item]:
    """Rows {"image" or "video", "id"?, "prompt"?}; a relative path is relative to the JSONL's folder."""
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{number}: not valid JSON ({e.msg})") from e
            kinds = [k for k in ("image", "video") if isinstance(row, dict) and isinstance(row.get(k), str)]
            if len(kinds) != 1:
                raise UsageError(f"{path}:{number}: a row needs an \"image\" (an image or a PDF) or a \"video\" "
                                 "path (a string), not both")
            prompt = row.get("prompt")
            if prompt is not None and not isinstance(prompt, str):
                raise UsageError(f"{path}:{number}: \"prompt\" must be a string")
            media = row[kinds[0]]
            item_id = str(row["id"]) if row.get("id") is not None else media
            media = str(path.parent / media) if not os.path.isabs(media) else media
            items.append(Item(item_id, media, prompt, kind_of(media) if kinds[0] == "image" else "video"))
    return items


def _check_unique(items: list[Item], source: str) -> None:
    dupes = [i for i, n in Counter(item.id for item in items).items() if n > 1]
    if dupes:
        shown = ", ".join(repr(d) for d in dupes[:5]) + (f" and {len(dupes) - 5} more" if len(dupes) > 5 else "")
        raise UsageError(f"duplicate ids in {source}: {shown}; every item needs its own id for resume to work")
