"""The index's store: a folder holding `entries.sqlite` (the source of truth) and a FAISS
search graph derived from it.

entries.sqlite, in WAL mode: one entry per embedded page (or image, or clip) keyed by the
content hash of its file and its page number, with its vector (float32); the files holding
each content (path, hash, size, mtime, pages); the folders added; the index's settings (the
model, the dimensions, the instructions). Every entry is committed in a transaction of its
own, so a killed `qvl index add` leaves every entry it finished and nothing half-written.
Entries are only added or deleted, never changed, and their ids are never reused
(AUTOINCREMENT): an id means one vector for good.

vectors-<store id>.faiss: an HNSW graph over the vectors (float16, inner product), written
to a temporary file and renamed over the old one. It may lag behind the database (a killed
add, another process adding): when it is loaded, the entries it lacks are added to it and
the ones deleted since are left out of searches (it is rebuilt from the database when those
are many, or when the file is missing or unreadable). A search rescores the graph's
candidates exactly from the database's float32 vectors.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import psutil

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS roots (path TEXT PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, hash TEXT NOT NULL, kind TEXT NOT NULL, "
    "size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, pages INTEGER)",
    "CREATE INDEX IF NOT EXISTS files_hash ON files (hash)",
    "CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY AUTOINCREMENT, hash TEXT NOT NULL, "
    "page INTEGER NOT NULL, vector BLOB NOT NULL, UNIQUE (hash, page))",
]
DATABASE = "entries.sqlite"
HNSW_M = 32  # graph links per vector
HNSW_EF_CONSTRUCTION = 40
HNSW_EF_SEARCH = 256  # candidates a search explores (at least k)
REBUILD_FRACTION = 0.2  # deleted entries past this share of the graph: rebuild it
WHOLE_FILE = 0  # the page of an image's or a clip's one entry (a PDF's pages count from 1)
READ_CHUNK = 4096  # vectors read from the database at a time when filling the graph


def faiss_module():
    """faiss, or an error naming the extra that installs it."""
    try:
        import faiss
    except ImportError:
        raise RuntimeError("the index needs FAISS: pip install 'qvl[index]'  (or: pip install faiss-cpu)") from None
    return faiss


@dataclass(frozen=True)
class FileRow:
    path: str  # absolute
    hash: str  # sha256 of the content
    kind: str  # image | pdf | video
    size: int
    mtime_ns: int
    pages: int | None  # a PDF's page count


@dataclass(frozen=True)
class Hit:
    id: int
    path: str
    kind: str
    page: int | None  # a PDF's page, None for an image or a clip
    score: float  # cosine similarity to the query

    def to_dict(self) -> dict:
        return {"path": self.path, "page": self.page, "kind": self.kind, "score": self.score}


class Graph:
    """FAISS's HNSW over float16 vectors, by entry id; `deleted` ids are skipped by searches."""

    def __init__(self, index):
        self.index = index
        self.deleted = np.zeros(0, np.int64)

    @classmethod
    def new(cls, dims: int) -> Graph:
        faiss = faiss_module()
        hnsw = faiss.IndexHNSWSQ(dims, faiss.ScalarQuantizer.QT_fp16, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        return cls(faiss.IndexIDMap(hnsw))

    @classmethod
    def load(cls, path: Path, dims: int) -> Graph | None:
        """The graph saved at `path`; None when there is none usable (missing, unreadable, other dims)."""
        faiss = faiss_module()
        if not path.is_file():
            return None
        try:
            index = faiss.read_index(str(path))
        except RuntimeError:  # missing or damaged: rebuilt from the database
            return None
        return cls(index) if index.d == dims else None

    def ids(self) -> np.ndarray:
        return faiss_module().vector_to_array(self.index.id_map).astype(np.int64)

    @property
    def live(self) -> int:
        return self.index.ntotal - len(self.deleted)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """ids [n] int64, vectors [n, d] float32."""
        self.index.add_with_ids(np.ascontiguousarray(vectors, np.float32), np.asarray(ids, np.int64))

    def search(self, vector: np.ndarray, k: int) -> list[int]:
        """The ids of about the k entries nearest to vector [d] (inner product), deleted ones skipped."""
        faiss = faiss_module()
        params = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, k))
        if len(self.deleted):
            params.sel = faiss.IDSelectorNot(faiss.IDSelectorBatch(self.deleted))
        _, ids = self.index.search(np.ascontiguousarray(vector[None], np.float32), k, params=params)
        return [int(i) for i in ids[0] if i >= 0]

    def save(self, path: Path) -> None:
        """Write to a temporary file beside `path`, then rename it over: a reader or a kill
        sees the old graph or the new one, whole. Temporary files of killed writers go."""
        for stale in path.parent.glob(f"{path.name}.*.tmp"):
            if not psutil.pid_exists(int(stale.suffixes[-2][1:])):
                stale.unlink(missing_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        faiss_module().write_index(self.index, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)


class Store:
    """One index folder. Thread-safe (one lock); several processes may use it at once (one
    adding, others searching: they see its entries as they are committed)."""

    def __init__(self, folder: Path, db: sqlite3.Connection):
        self.folder, self.db = folder, db
        self.lock = threading.RLock()
        self.meta = dict(db.execute("SELECT key, value FROM meta"))
        self.dims = int(self.meta["dimensions"])
        self._graph: Graph | None = None  # loaded by the first search or add
        self._synced: int | None = None  # the database's data_version when the graph was last synced

    @classmethod
    def open(cls, folder: str | Path, settings: dict[str, str] | None = None) -> Store:
        """The store in `folder`. `settings` (model, dimensions, ...) create it when there is
        none yet; without them a missing store is an error."""
        folder = Path(folder)
        exists = (folder / DATABASE).is_file()
        if not exists and settings is None:
            raise ValueError(f"no index at {folder} (make one with: qvl index add DOCS/ --db {folder} --model MODEL)")
        if not exists and folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise ValueError(f"{folder} exists and is not an index: give a new or empty folder for --db")
        folder.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(folder / DATABASE, check_same_thread=False, isolation_level=None, timeout=60)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # in WAL mode a killed process keeps every committed transaction
        for statement in SCHEMA:
            db.execute(statement)
        if not exists:
            with transaction(db):
                db.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)",
                               [("store_id", uuid.uuid4().hex), *settings.items()])
        return cls(folder, db)

    def close(self) -> None:
        self.db.close()

    @property
    def graph_path(self) -> Path:
        return self.folder / f"vectors-{self.meta['store_id']}.faiss"

    # -- files and entries --------------------------------------------------------------------

    def _rows(self, sql: str, args=()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, args).fetchall()

    def file(self, path: str) -> FileRow | None:
        rows = self._rows("SELECT * FROM files WHERE path = ?", (path,))
        return FileRow(*rows[0]) if rows else None

    def pages_of(self, content: str) -> set[int]:
        """The pages of a content (hash) already embedded."""
        return {p for (p,) in self._rows("SELECT page FROM entries WHERE hash = ?", (content,))}

    def put_files(self, rows: list[FileRow]) -> None:
        with self.lock, transaction(self.db):
            self._upsert(rows)

    def _upsert(self, rows: list[FileRow]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)", [astuple(r) for r in rows])

    def add(self, files: list[FileRow], page: int, vector: np.ndarray) -> None:
        """One entry: the vector [d] of page `page` of the content the files hold, and the
        files, committed together; then into the graph if it is loaded."""
        content = files[0].hash
        with self.lock:
            with transaction(self.db):
                cursor = self.db.execute("INSERT OR IGNORE INTO entries (hash, page, vector) VALUES (?, ?, ?)",
                                         (content, page, np.asarray(vector, "<f4").tobytes()))
                self._upsert(files)
            if self._graph is not None and cursor.rowcount:
                self._graph.add(np.array([cursor.lastrowid]), vector[None])

    def add_root(self, path: str) -> None:
        with self.lock, transaction(self.db):
            self.db.execute("INSERT OR IGNORE INTO roots VALUES (?)", (path,))

    def roots(self) -> list[str]:
        return [p for (p,) in self._rows("SELECT path FROM roots ORDER BY path")]

    def paths(self) -> list[str]:
        return [p for (p,) in self._rows("SELECT path FROM files ORDER BY path")]

    def files(self) -> list[tuple[FileRow, int]]:
        """Each file and the entries its content has, by path."""
        rows = self._rows("SELECT f.*, (SELECT COUNT(*) FROM entries e WHERE e.hash = f.hash) FROM files f "
                          "ORDER BY f.path")
        return [(FileRow(*row[:6]), row[6]) for row in rows]

    def forget(self, paths: list[str]) -> int:
        """Remove these files, then every entry no file holds any more; returns the files removed."""
        with self.lock:
            with transaction(self.db):
                files = sum(self.db.execute("DELETE FROM files WHERE path = ?", (p,)).rowcount for p in paths)
                entries = self.db.execute("DELETE FROM entries WHERE hash NOT IN (SELECT hash FROM files)").rowcount
            if entries:
                self._synced = None  # the graph learns of the deletions at its next sync
            return files

    def counts(self) -> dict:
        """Entries, files (and by kind), the folders added."""
        entries = self._rows("SELECT COUNT(*) FROM entries")[0][0]
        kinds = dict(self._rows("SELECT kind, COUNT(*) FROM files GROUP BY kind"))
        return {"entries": entries, "files": sum(kinds.values()), "files_by_kind": kinds, "roots": self.roots()}

    def vectors(self, ids: list[int]) -> dict[int, np.ndarray]:
        rows = self._rows(f"SELECT id, vector FROM entries WHERE id IN ({','.join('?' * len(ids))})", ids)
        return {i: np.frombuffer(blob, "<f4") for i, blob in rows}

    # -- the graph ------------------------------------------------------------------------------

    def graph(self) -> Graph:
        """The search graph, in step with the database: loaded (or built) the first time, then
        brought up to date whenever another connection has committed since."""
        with self.lock:
            version = self.db.execute("PRAGMA data_version").fetchone()[0]
            if self._graph is None or self._synced != version:
                self._graph = self._synced_graph(self._graph or Graph.load(self.graph_path, self.dims))
                self._synced = version
            return self._graph

    def _synced_graph(self, graph: Graph | None) -> Graph:
        ids = np.array([i for (i,) in self._rows("SELECT id FROM entries")], np.int64)
        have = graph.ids() if graph is not None else np.zeros(0, np.int64)
        deleted = np.setdiff1d(have, ids)
        if graph is None or len(deleted) > REBUILD_FRACTION * len(have):
            graph, have, deleted = Graph.new(self.dims), np.zeros(0, np.int64), np.zeros(0, np.int64)
        missing = np.setdiff1d(ids, have)
        for start in range(0, len(missing), READ_CHUNK):
            chunk = missing[start:start + READ_CHUNK].tolist()
            found = self.vectors(chunk)
            chunk = [i for i in chunk if i in found]  # deleted meanwhile by another process
            if chunk:
                graph.add(np.array(chunk, np.int64), np.stack([found[i] for i in chunk]))
        graph.deleted = deleted
        return graph

    def save_graph(self) -> None:
        """Write the graph (as synced) for the next process to load."""
        with self.lock:
            self.graph().save(self.graph_path)

    def search(self, vector: np.ndarray, k: int) -> list[Hit]:
        """The k entries nearest to vector [d], best first, each with its file (the first path
        holding its content) and its exact cosine."""
        with self.lock:
            graph = self.graph()
            ids = graph.search(vector, k) if graph.live else []
            if not ids:
                return []
            marks = ",".join("?" * len(ids))
            rows = self.db.execute(
                f"SELECT e.id, MIN(f.path), f.kind, e.page, e.vector FROM entries e JOIN files f ON f.hash = e.hash "
                f"WHERE e.id IN ({marks}) GROUP BY e.id", ids).fetchall()
        hits = [Hit(i, path, kind, page or None, float(np.frombuffer(blob, "<f4") @ vector))
                for i, path, kind, page, blob in rows]
        return sorted(hits, key=lambda h: -h.score)


@contextmanager
def transaction(db: sqlite3.Connection):
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any error (the connection in autocommit mode)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
