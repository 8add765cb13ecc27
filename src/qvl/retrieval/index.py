"""An index of a folder's images, PDF pages and clips: embedded by an embedding model on the
engine's scheduler (as many at once as it has rows), kept in a Store, searched by text or
image.

`add` hashes every file (sha256, reused while a file's size and mtime stay the same), embeds
each (content, page) the store lacks, and commits each vector as it comes, so a run that is
killed loses at most the inputs in flight and the next one goes on from there. A file that
cannot be read is skipped with its reason and counted; the run goes on. Files gone from a
folder added before, and files whose content changed, leave the index (with their entries,
unless another file holds the same content).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from qvl.batch.inputs import MEDIA_EXTENSIONS, kind_of
from qvl.batch.progress import Progress
from qvl.retrieval.encode import embed, embedding, parse_embedding, rerank
from qvl.retrieval.store import WHOLE_FILE, FileRow, Hit, Store
from qvl.retrieval.task import EMBED, wrong_task
from qvl.scheduler import Sequence
from qvl.stream import Done

QUERY_INSTRUCTION = "Retrieve images or text relevant to the user's query."  # the reference's retrieval queries
SAVE_EVERY_S = 300.0  # the search graph is written this often while adding (and at the end)
HASH_BLOCK = 1 << 20


def parts_of(path: str, kind: str, page: int | None) -> list[dict]:
    """The content parts that embed one entry: a clip, an image, or a PDF's page."""
    if kind == "video":
        return [{"type": "video", "video": path}]
    return [{"type": "image", "image": f"{path}#pages={page}" if kind == "pdf" else path}]


@dataclass(frozen=True)
class Work:
    """One entry to embed: a page of a content (or the whole of it), and every file holding it."""

    files: tuple[FileRow, ...]  # the first one is read
    page: int  # a PDF's page, or WHOLE_FILE

    @property
    def label(self) -> str:
        first = self.files[0]
        return f"{first.path} page {self.page}" if first.kind == "pdf" else first.path

    def parts(self) -> list[dict]:
        first = self.files[0]
        return parts_of(first.path, first.kind, self.page)


@dataclass
class AddSummary:
    added: int = 0  # entries embedded in this run
    present: int = 0  # entries already in the index
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file or page, why)
    removed: int = 0  # files gone (or changed) since they were indexed
    interrupted: bool = False
    started: float = field(default_factory=time.perf_counter)

    def skip(self, label: str, reason: str) -> None:
        self.skipped.append((label, reason))
        tqdm.write(f"qvl index add: skipped {label}: {reason}", file=sys.stderr)

    def line(self) -> str:
        minutes = (time.perf_counter() - self.started) / 60
        rate = f", {self.added / minutes:.1f} entries/min" if self.added and minutes > 0 else ""
        return (f"{'interrupted' if self.interrupted else 'finished'}: added {self.added}, already indexed "
                f"{self.present}, skipped {len(self.skipped)} unreadable, removed {self.removed} file(s) gone or "
                f"changed{rate}")

    def exit_code(self) -> int:
        """130 after Ctrl-C, 1 when an input was skipped, else 0."""
        return 130 if self.interrupted else 1 if self.skipped else 0


def content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def file_row(path: Path, known: FileRow | None) -> FileRow:
    """What the store should hold of a file: its row as stored (`known`) while its size and
    mtime are unchanged, else hashed (and a PDF's pages counted) anew. OSError or PdfError when
    unreadable."""
    stat = path.stat()
    if known and (known.size, known.mtime_ns) == (stat.st_size, stat.st_mtime_ns):
        return known
    kind = kind_of(path)
    pages = None
    if kind == "pdf":
        from qvl.processing.pdf import page_count

        pages = page_count(path)
    return FileRow(str(path), content_hash(path), kind, stat.st_size, stat.st_mtime_ns, pages)


def media_files(root: Path) -> list[Path]:
    """The images, PDFs and clips under `root` (recursively), sorted, as absolute paths."""
    return sorted(Path(os.path.abspath(p)) for p in root.rglob("*")
                  if p.suffix.lower() in MEDIA_EXTENSIONS and p.is_file())


def scan(store: Store, roots: list[Path], summary: AddSummary) -> list[Work]:
    """The entries the store lacks under `roots`. Records the files whose entries are all there,
    and forgets the files gone from the roots or changed since."""
    by_content: dict[str, list[FileRow]] = {}
    gone: list[str] = []
    for root in roots:
        found = media_files(root)
        seen = {str(p) for p in found}
        under = str(root) + os.sep
        gone += [p for p in store.paths() if p.startswith(under) and p not in seen]
        for path in found:
            known = store.file(str(path))
            try:
                row = file_row(path, known)
            except (OSError, ValueError) as exc:  # PdfError is a ValueError
                summary.skip(str(path), str(exc))
                gone.append(str(path))
                continue
            if known and known.hash != row.hash:
                gone.append(row.path)
            by_content.setdefault(row.hash, []).append(row)
    summary.removed = store.forget(sorted(set(gone)))
    work, complete = [], []
    for content, rows in by_content.items():
        done = store.pages_of(content)
        pages = range(1, rows[0].pages + 1) if rows[0].kind == "pdf" else [WHOLE_FILE]
        todo = [p for p in pages if p not in done]
        summary.present += len(pages) - len(todo)
        work += [Work(tuple(rows), p) for p in todo]
        complete += rows if not todo else []
    store.put_files(complete)
    return work


def embedded(engine, work: Iterable[Work], instruction: str | None,
             dimensions: int | None) -> Iterator[tuple[Work, np.ndarray | Exception]]:
    """Each work's vector [d] float32, or the exception that stopped it, in the order they
    finish: up to the scheduler's rows of them in flight, each replaced by the next as it ends."""
    source, finished = iter(work), deque()
    running = [0]

    def answered(item: Work, event) -> None:
        if isinstance(event, (Done, BaseException)):
            finished.append((item, event))
            running[0] -= 1

    engine.scheduler.slice_s = None  # nobody waits on a stream: whole prefills, fewer passes over the weights
    while True:
        while running[0] < engine.scheduler.max_batch and (item := next(source, None)) is not None:
            try:
                parsed = parse_embedding(engine, item.parts(), instruction)
            except Exception as exc:  # an unreadable input must not stop the run
                yield item, exc
                continue
            running[0] += 1
            engine.scheduler.submit(Sequence(parsed, lambda event, item=item: answered(item, event)))
        while finished:
            item, event = finished.popleft()
            yield item, event if isinstance(event, BaseException) else embedding(event.hidden, dimensions).numpy()
        if not running[0]:
            return
        engine.scheduler.step()


def dimensions_of(store: Store, engine) -> int | None:
    """The dimensions to keep (None: all the model's)."""
    return store.dims if store.dims < engine.cfg.text.hidden_size else None


def require_embedding_model(engine) -> None:
    if engine.task != EMBED:
        raise wrong_task(engine.model_name, engine.task, EMBED)


def add(engine, store: Store, roots: list[Path], progress_interval: float = 10.0) -> AddSummary:
    """Index what `roots` hold that `store` lacks; see the module's docstring."""
    require_embedding_model(engine)
    summary = AddSummary()
    roots = [Path(os.path.abspath(root)) for root in roots]
    for root in roots:
        store.add_root(str(root))
    store.graph()  # loaded (or caught up with the database) before the new entries go in
    work = scan(store, roots, summary)
    tqdm.write(f"qvl index add: {len(work)} to embed, {summary.present} already indexed", file=sys.stderr)
    progress, saved = Progress(len(work), progress_interval, name="qvl index add"), time.monotonic()
    try:
        for item, result in embedded(engine, work, store.meta.get("instruction"), dimensions_of(store, engine)):
            if isinstance(result, Exception):
                summary.skip(item.label, str(result))
            else:
                store.add(list(item.files), item.page, result)
                summary.added += 1
            progress.update(not isinstance(result, Exception))
            if time.monotonic() - saved > SAVE_EVERY_S:
                store.save_graph()
                saved = time.monotonic()
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        progress.close()
    store.save_graph()
    return summary


def search(engine, store: Store, query: list[dict], k: int, instruction: str | None = None) -> list[Hit]:
    """The k entries nearest to the query (content parts), best first."""
    require_embedding_model(engine)
    vectors, _ = embed(engine, [query], instruction or store.meta.get("query_instruction"),
                       dimensions_of(store, engine))
    return store.search(vectors[0].numpy(), k)


def reranked(reranker, query: list[dict], hits: list[Hit], instruction: str | None = None) -> list[tuple[Hit, float]]:
    """The hits with their relevance to the query by a reranker, most relevant first."""
    if not hits:
        return []
    scores, _ = rerank(reranker, query, [parts_of(h.path, h.kind, h.page) for h in hits], instruction)
    return sorted(zip(hits, scores), key=lambda pair: -pair[1])
