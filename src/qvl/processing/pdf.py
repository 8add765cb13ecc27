"""PDF pages -> images, rasterised by pdfium (pypdfium2) at the resolution the image budget
wants: a page is drawn at about as many pixels as its tokens will hold, never more, so a
scanned page costs what a photo of it would.

`doc.pdf#pages=2-4` (or `pages="2,5-7"`) selects pages, counted from 1 as readers show them.

pdfium runs in worker processes (qvl.processing.pdf_worker), never in this one: it is not
thread-safe, and a small hostile PDF can make it take gigabytes and minutes or crash it. A
worker may use `LIMITS.memory_mb` of address space and `LIMITS.seconds` to open a document or
to load and draw one page; past either it is killed and the page refused by name. Workers are
reused (starting one costs about a fifth of a second), one per thread drawing at a time.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from qvl.processing import pdf_worker
from qvl.processing.image import MAX_ASPECT_RATIO, ImageError

log = logging.getLogger("qvl.pdf")

MAX_PAGES = 64  # pages one request may take (a batch job takes every page, one row each)
MAX_SIDE_PT = 14400  # the largest page side PDF allows (200 inches)
MAX_SCALE = 600 / 72  # never render beyond 600 dpi, however large the budget
PAGES_FRAGMENT = re.compile(r"#pages?=([0-9,\- ]+)$", re.IGNORECASE)
KEEP_WORKERS = 2  # idle workers kept for the next document (the server parses 2 requests at once)
RECYCLE_MB = 256  # a worker left this large by a heavy page is ended, not kept
START_SECONDS = 60.0  # a worker not ready by then is broken (not the PDF's fault)


@dataclass(frozen=True)
class PageLimits:
    """What opening a PDF, or loading and drawing one of its pages, may cost. Ordinary pages
    take far less: under 100 MB and about a second for a 600 dpi scan or 200,000 vector strokes."""

    memory_mb: int = 1024  # the worker's whole address space (about 30 MB of it is Python and pdfium)
    seconds: float = 20.0  # wall clock


LIMITS = PageLimits()


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


class Worker:
    """One pdf_worker process, used by one thread at a time. A reply missing at the deadline
    or cut off by the worker's death ends the worker and raises PdfError naming what it was
    doing and which limit was passed."""

    def __init__(self, limits: PageLimits):
        self.limits, self.expired = limits, False
        boot = f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); " \
               "from qvl.processing.pdf_worker import main; main()"
        # -I: the worker reads neither PYTHONPATH nor the working folder; the exec happens at
        # once, so this is safe from a process with threads.
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", boot, str(limits.memory_mb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        timer = threading.Timer(START_SECONDS, self.proc.kill)
        timer.start()
        ready = pdf_worker.receive(self.proc.stdout)
        timer.cancel()
        if ready is None:
            self.end()
            raise RuntimeError(f"the PDF worker process did not start (exit status {self.proc.returncode}; "
                               "its error is on stderr)")

    def call(self, header: dict, payload: bytes = b"", *, deadline: float, what: str,
             doing: str) -> tuple[dict, bytes]:
        """The worker's reply to one command, if it comes before `deadline` (time.monotonic())."""
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        timer.start()
        try:
            pdf_worker.send(self.proc.stdin, header, payload)
            reply = pdf_worker.receive(self.proc.stdout)
        except OSError:  # the worker died before it read everything
            reply = None
        except BaseException:  # interrupted (Ctrl-C): a reply may still come, so the worker cannot be reused
            self.proc.kill()
            self.end()
            raise
        finally:
            timer.cancel()
        if reply is None or self.expired:
            self.end()
            raise self.refusal(what, doing)
        return reply

    def _expire(self) -> None:
        self.expired = True
        self.proc.kill()

    def refusal(self, what: str, doing: str) -> PdfError:
        if self.expired:
            log.warning("PDF worker killed: %s took over %g s to %s", what, self.limits.seconds, doing)
            return PdfError(f"{what} exceeds the limit of {self.limits.seconds:g} s to {doing}: refused")
        log.warning("PDF worker died (exit status %s) trying to %s %s", self.proc.returncode, doing, what)
        return PdfError(f"{what} exceeds the limit of {self.limits.memory_mb} MB of memory to {doing} (or breaks "
                        "the PDF renderer): refused")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss / pdf_worker.MB
        except psutil.Error:
            return math.inf

    def end(self) -> None:
        """Stop the process (closing its input ends it; killed if it lingers) and reap it."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


IDLE: list[Worker] = []
IDLE_LOCK = threading.Lock()


@atexit.register
def end_idle() -> None:
    with IDLE_LOCK:
        while IDLE:
            IDLE.pop().end()


@contextmanager
def worker(limits: PageLimits):
    """An idle worker with these limits, or a new one; kept afterwards if it is alive, small
    and fewer than KEEP_WORKERS others wait."""
    with IDLE_LOCK:
        found = next((w for w in IDLE if w.limits == limits), None)
        if found is not None:
            IDLE.remove(found)
    if found is not None and not found.alive():  # killed while idle (by the OOM killer, an operator)
        found.end()
        found = None
    found = found or Worker(limits)
    try:
        yield found
    finally:
        keep = found.alive() and found.rss_mb() < RECYCLE_MB
        with IDLE_LOCK:
            keep = keep and len(IDLE) < KEEP_WORKERS
            if keep:
                IDLE.append(found)
        if not keep:
            found.end()


@contextmanager
def opened(source, limits: PageLimits | None = None):
    """(a worker holding the document open, its page count), from bytes or a path; raises
    PdfError naming what is wrong."""
    limits = limits or LIMITS
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise PdfError(f"PDF file not found: {path}")
        header, data, where, kept = {"op": "open", "path": str(path)}, b"", f" ({path})", path
    else:
        header, data, where = {"op": "open", "path": None}, bytes(source), ""
        kept = data
    with worker(limits) as drawer:
        reply, _ = drawer.call(header, data, deadline=time.monotonic() + limits.seconds, what="the PDF",
                               doing="open")
        try:
            if "error" in reply:
                raise open_error(reply["error"], kept, where)
            if reply["pages"] == 0:
                raise PdfError(f"the PDF{where} has no pages")
            yield drawer, reply["pages"]
        finally:
            if drawer.alive():
                drawer.call({"op": "close"}, deadline=time.monotonic() + limits.seconds, what="the PDF",
                            doing="close")


def open_error(reason: str, source: bytes | Path, where: str) -> PdfError:
    """Why pdfium would not open a document, in a user's words."""
    if "password" in reason.lower():
        return PdfError(f"the PDF{where} is encrypted: qvl cannot open password-protected PDFs")
    if _pageless(source):  # pdfium refuses a document whose page tree is empty, as unreadable
        return PdfError(f"the PDF{where} has no pages")
    return PdfError(f"not a readable PDF{where}: {reason}")


def _pageless(source: bytes | Path) -> bool:
    """Whether a PDF pdfium would not open declares no page at all (a page tree of /Count 0
    and no page object), so the refusal can say so."""
    data = source if isinstance(source, bytes) else source.read_bytes()
    return bool(re.search(rb"/Count\s+0\b", data)) and not re.search(rb"/Type\s*/Page\b(?!s)", data)


def page_count(source, limits: PageLimits | None = None) -> int:
    with opened(source, limits) as (_, count):
        return count


def render_pages(source, pages: str | None = None, *, max_pixels: int, max_pages: int = MAX_PAGES,
                 limits: PageLimits | None = None) -> list[Image.Image]:
    """The selected pages as RGB PIL images, each drawn at about `max_pixels` pixels (its
    rotation applied, as a reader shows it). Raises PdfError."""
    with opened(source, limits) as (drawer, count):
        numbers = parse_pages(pages, count, limit=max(max_pages, 1) * 4)
        if len(numbers) > max_pages:
            raise PdfError(f"{len(numbers)} pages asked for, but only {max_pages} more image(s) fit this "
                           "request (pages count as images): select pages (image_url.pages in the API, "
                           "doc.pdf#pages=2-4 on the command line), or run qvl batch, which takes each page "
                           "as an item")
        return [render_page(drawer, n, max_pixels) for n in numbers]


def render_page(drawer: Worker, number: int, max_pixels: int) -> Image.Image:
    """Page `number` (1-based) of the worker's document at the scale that gives about
    `max_pixels`, loaded and drawn within the worker's limits."""
    what = f"page {number} of the PDF"
    deadline = time.monotonic() + drawer.limits.seconds
    size, _ = drawer.call({"op": "load", "page": number}, deadline=deadline, what=what, doing="draw")
    width, height = size["width"], size["height"]  # points, rotation applied
    if not (1 <= width <= MAX_SIDE_PT and 1 <= height <= MAX_SIDE_PT):
        raise PdfError(f"page {number} is {width:.0f} x {height:.0f} points: outside what PDF allows "
                       f"(1 to {MAX_SIDE_PT})")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise PdfError(f"page {number} has an aspect ratio of {max(width, height) / min(width, height):.0f}, "
                       f"over {MAX_ASPECT_RATIO}")
    scale = min(math.sqrt(max_pixels / (width * height)), MAX_SCALE)
    drawn, pixels = drawer.call({"op": "draw", "scale": scale}, deadline=deadline, what=what, doing="draw")
    return Image.frombuffer("RGB", (drawn["width"], drawn["height"]), pixels, "raw", "BGR", drawn["stride"], 1)
