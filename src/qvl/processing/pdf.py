"""PDF pages -> images, rasterised by pdfium (pypdfium2) at the resolution the image budget
wants: a page is drawn at about as many pixels as its tokens will hold, never more, so a
scanned page costs what a photo of it would.

`doc.pdf#pages=2-4` (or `pages="2,5-7"`) selects pages, counted from 1 as readers show them.
"""

from __future__ import annotations

import math
import os
import re
import threading
from pathlib import Path

from qvl.processing.image import MAX_ASPECT_RATIO, ImageError

MAX_PAGES = 64  # pages one request may take (a batch job takes every page, one row each)
MAX_SIDE_PT = 14400  # the largest page side PDF allows (200 inches)
MAX_SCALE = 600 / 72  # never render beyond 600 dpi, however large the budget
PAGES_FRAGMENT = re.compile(r"#pages?=([0-9,\- ]+)$", re.IGNORECASE)
# pdfium must never run in two threads at once, not even on different documents (pypdfium2's
# documentation: the process may crash); the server parses requests in threads.
PDFIUM = threading.RLock()


class PdfError(ImageError):
    """A PDF that cannot be used; the message names the problem."""


def is_pdf(source) -> bool:
    """A path ending in .pdf (before any #pages=), or bytes that start like a PDF."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[:1024]).lstrip().startswith(b"%PDF")
    if isinstance(source, (str, os.PathLike)):
        return split_pages(str(source))[0].lower().endswith(".pdf")
    return False


def split_pages(path: str) -> tuple[str, str | None]:
    """'doc.pdf#pages=2-4' -> ('doc.pdf', '2-4'); a path without a page fragment -> (path, None)."""
    match = PAGES_FRAGMENT.search(path)
    return (path[:match.start()], match.group(1)) if match else (path, None)


def parse_pages(spec: str | None, count: int, limit: int = 10**6) -> list[int]:
    """'2-4,7' -> [2, 3, 4, 7] (1-based, in the order given, no repeats); None -> every page.
    A selection of more than `limit` pages (repeats counted) is refused before it is listed."""
    if spec is None:
        if count > limit:
            raise PdfError(f"the PDF has {count} pages; at most {limit} are taken at once")
        return list(range(1, count + 1))
    ranges = []
    for part in (p.strip() for p in spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise PdfError(f"bad page selection '{spec}': use numbers and ranges such as 2-4,7")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if not 1 <= first <= last:
            raise PdfError(f"bad page range '{part}' in '{spec}': pages count from 1, ranges go up")
        if last > count:
            raise PdfError(f"page {last} asked for, but the PDF has {count} page{'s' * (count != 1)}")
        ranges.append(range(first, last + 1))
    if sum(len(r) for r in ranges) > limit:  # before listing them: a tiny PDF may claim a million pages
        raise PdfError(f"{sum(len(r) for r in ranges)} pages asked for; at most {limit}")
    seen: set[int] = set()
    return [p for r in ranges for p in r if not (p in seen or seen.add(p))]


def open_pdf(source):
    """A pypdfium2 document from bytes or a path; raises PdfError naming what is wrong. Hold
    PDFIUM while the document is in use."""
    import pypdfium2 as pdfium

    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise PdfError(f"PDF file not found: {path}")
        source, where = str(path), f" ({path})"
    else:
        source, where = bytes(source), ""
    try:
        doc = pdfium.PdfDocument(source)
    except pdfium.PdfiumError as e:
        reason = str(e)
        if "password" in reason.lower():
            raise PdfError(f"the PDF{where} is encrypted: qvl cannot open password-protected PDFs") from None
        if _pageless(source):  # pdfium refuses a document whose page tree is empty, as unreadable
            raise PdfError(f"the PDF{where} has no pages") from None
        raise PdfError(f"not a readable PDF{where}: {reason}") from None
    if len(doc) == 0:
        doc.close()
        raise PdfError(f"the PDF{where} has no pages")
    return doc


def _pageless(source: bytes | str) -> bool:
    """Whether a PDF pdfium would not open declares no page at all (a page tree of /Count 0
    and no page object), so the refusal can say so."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    return bool(re.search(rb"/Count\s+0\b", data)) and not re.search(rb"/Type\s*/Page\b(?!s)", data)


def page_count(source) -> int:
    with PDFIUM:
        doc = open_pdf(source)
        try:
            return len(doc)
        finally:
            doc.close()


def render_pages(source, pages: str | None = None, *, max_pixels: int, max_pages: int = MAX_PAGES):
    """The selected pages as RGB PIL images, each drawn at about `max_pixels` pixels (its
    rotation applied, as a reader shows it). Raises PdfError."""
    with PDFIUM:
        doc = open_pdf(source)
        try:
            numbers = parse_pages(pages, len(doc), limit=max(max_pages, 1) * 4)
            if len(numbers) > max_pages:
                raise PdfError(f"{len(numbers)} pages asked for, but only {max_pages} more image(s) fit this "
                               "request (pages count as images): select pages (image_url.pages in the API, "
                               "doc.pdf#pages=2-4 on the command line), or run qvl batch, which takes each page "
                               "as an item")
            return [render_page(doc, n, max_pixels) for n in numbers]
        finally:
            doc.close()


def render_page(doc, number: int, max_pixels: int):
    """Page `number` (1-based) of an open document at the scale that gives about `max_pixels`."""
    page = doc[number - 1]
    try:
        width, height = page.get_size()  # points, rotation applied
        if not (1 <= width <= MAX_SIDE_PT and 1 <= height <= MAX_SIDE_PT):
            raise PdfError(f"page {number} is {width:.0f} x {height:.0f} points: outside what PDF allows "
                           f"(1 to {MAX_SIDE_PT})")
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise PdfError(f"page {number} has an aspect ratio of {max(width, height) / min(width, height):.0f}, "
                           f"over {MAX_ASPECT_RATIO}")
        scale = min(math.sqrt(max_pixels / (width * height)), MAX_SCALE)
        bitmap = page.render(scale=scale, may_draw_forms=True)
        try:
            return bitmap.to_pil().convert("RGB")
        finally:
            bitmap.close()  # now, under the lock: not later from another thread
    finally:
        page.close()
