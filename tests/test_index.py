"""`qvl index`: a folder's images and PDF pages embedded into a store (sqlite + a FAISS graph)
by the tiny embedding checkpoint, searched by image (random weights: a picture finds itself,
and the stored vectors are the engine's own), resumed without embedding anything twice (after
a SIGKILL too), unreadable inputs skipped with their reasons; the CLI's JSON; the server's
/v1/search (reranked by a served reranker when asked) and its thumbnails, confined to the
indexed folders (the web page's search box: tests/test_server_web.py)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from qvl.bench import synthetic_clip
from qvl.cli import main
from qvl.engine import EngineOptions
from qvl.options import UsageError
from qvl.retrieval.encode import embed
from qvl.retrieval.index import add, reranked, search
from qvl.retrieval.store import DATABASE, Store
from qvl.server.app import create_app
from qvl.server.cli import with_reranker
from qvl.server.registry import ModelSource
from qvl.server.settings import MB, ImagePolicy, ServerSettings
from tests.test_documents import pdf_bytes
from tests.test_retrieval import fp32_engine, noise_image
from tests.test_server_api import assert_error, wait_ready
from tests.test_server_support import data_uri

ENGINE_FLAGS = ["--weights", "fp32", "--threads", "2", "--max-image-tokens", "64"]  # what fp32_engine loads


@pytest.fixture(scope="module")
def embedder(tiny_embedding_checkpoint):
    """An engine of the index's own (adding sets its scheduler to whole prefills)."""
    return fp32_engine(tiny_embedding_checkpoint)


def write_docs(folder: Path, images: int = 3) -> Path:
    """img0.png ... (noise, each its own), sub/doc.pdf (2 pages), sub/clip.mp4 (2 s), a corrupt
    PNG and a corrupt PDF."""
    (folder / "sub").mkdir(parents=True)
    for i in range(images):
        noise_image(64, 64, seed=i).save(folder / f"img{i}.png")
    (folder / "sub" / "doc.pdf").write_bytes(pdf_bytes(2, size=(200, 260)))
    synthetic_clip(folder / "sub" / "clip.mp4", 2, 96, 64, fps=8)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    (folder / "sub" / "broken.pdf").write_bytes(b"%PDF-1.4\nnot a document\n")
    return folder


def new_store(path: Path, engine) -> Store:
    return Store.open(path, {"model": str(engine.path.resolve()), "dimensions": str(engine.cfg.text.hidden_size),
                             "instruction": "", "query_instruction": ""})


def entries(db: Path) -> list[tuple[str, int]]:
    """(hash, page) of each entry committed so far (none while the database is being made)."""
    try:
        with sqlite3.connect(db / DATABASE) as con:
            return con.execute("SELECT hash, page FROM entries ORDER BY hash, page").fetchall()
    except sqlite3.OperationalError:
        return []


def image_query(path: Path) -> list[dict]:
    return [{"type": "image", "image": str(path)}]


def make_index(engine, root: Path):
    """(docs folder, store, the first add's summary) in `root`."""
    docs = write_docs(root / "docs")
    store = new_store(root / "idx", engine)
    return docs, store, add(engine, store, [docs.resolve()])


@pytest.fixture(scope="module")
def indexed(embedder, tmp_path_factory):
    return make_index(embedder, tmp_path_factory.mktemp("index"))


def test_add_embeds_every_image_and_pdf_page_and_each_finds_itself(indexed, embedder):
    docs, store, summary = indexed
    assert (summary.added, summary.present) == (6, 0)  # 3 images + 2 pages + a clip
    for i in range(3):
        hits = search(embedder, store, image_query(docs / f"img{i}.png"), k=5)
        assert hits[0].path == str(docs.resolve() / f"img{i}.png") and hits[0].page is None
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        stored = store.vectors([hits[0].id])[hits[0].id]
        expected, _ = embed(embedder, [image_query(docs / f"img{i}.png")])  # the documents' (default) instruction
        np.testing.assert_allclose(stored, expected[0].numpy(), atol=1e-6)
    second = search(embedder, store, image_query(f"{docs}/sub/doc.pdf#pages=2"), k=1)[0]
    assert (second.path, second.page, second.kind) == (str(docs.resolve() / "sub/doc.pdf"), 2, "pdf")
    clip = search(embedder, store, [{"type": "video", "video": str(docs / "sub/clip.mp4")}], k=1)[0]
    assert (clip.path, clip.page, clip.kind) == (str(docs.resolve() / "sub/clip.mp4"), None, "video")


def test_unreadable_inputs_are_skipped_with_their_reasons(indexed):
    _, _, summary = indexed
    reasons = dict(summary.skipped)
    assert len(reasons) == 2 and summary.exit_code() == 1
    broken_png = next(r for label, r in reasons.items() if label.endswith("broken.png"))
    broken_pdf = next(r for label, r in reasons.items() if label.endswith("broken.pdf"))
    assert "not a recognised image" in broken_png
    assert "not a readable PDF" in broken_pdf


def test_adding_again_embeds_only_what_is_new_and_forgets_what_went(embedder, tmp_path):
    docs = write_docs(tmp_path / "docs")
    store = new_store(tmp_path / "idx", embedder)
    add(embedder, store, [docs])
    before = entries(tmp_path / "idx")
    again = add(embedder, store, [docs])
    assert (again.added, again.present) == (0, 6) and entries(tmp_path / "idx") == before
    reader = Store.open(tmp_path / "idx")  # another process's view, as a server's
    reader.graph()
    (docs / "copy.png").write_bytes((docs / "img0.png").read_bytes())  # same content: nothing to embed
    noise_image(64, 64, seed=9).save(docs / "sub" / "new.png")
    (docs / "img1.png").unlink()
    third = add(embedder, store, [docs])
    assert (third.added, third.removed) == (1, 1)
    paths = store.paths()
    assert str(docs / "copy.png") in paths and str(docs / "img1.png") not in paths
    assert len(entries(tmp_path / "idx")) == 6  # img1's entry went, new.png's came
    hits = search(embedder, store, image_query(docs / "sub" / "new.png"), k=5)
    assert hits[0].path == str(docs / "sub" / "new.png")
    assert str(docs / "img1.png") not in {h.path for h in hits}  # its entry is out of the graph's answers too
    vector, _ = embed(embedder, [image_query(docs / "sub" / "new.png")])
    seen = reader.search(vector[0].numpy(), 5)  # caught up with what the other connection committed
    assert seen[0].path == str(docs / "sub" / "new.png") and str(docs / "img1.png") not in {h.path for h in seen}


def test_a_damaged_search_graph_is_rebuilt_from_the_database(indexed, embedder, tmp_path):
    docs, store, _ = indexed
    store.db.execute("PRAGMA wal_checkpoint")
    copy = tmp_path / "idx"
    copy.mkdir()
    for f in store.folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    graph = next(copy.glob("vectors-*.faiss"))
    graph.write_bytes(graph.read_bytes()[:100])
    reopened = Store.open(copy)
    hits = search(embedder, reopened, image_query(docs / "img2.png"), k=1)
    assert hits[0].path == str(docs.resolve() / "img2.png")


def start_add(folder: Path, db: Path, checkpoint) -> subprocess.Popen:
    argv = [sys.executable, "-m", "qvl.cli", "index", "add", str(folder), "--db", str(db), "--model", str(checkpoint),
            "--max-batch", "1", *ENGINE_FLAGS]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # two `qvl index add` processes
def test_sigkill_during_add_then_add_again_indexes_every_file_exactly_once(tiny_embedding_checkpoint, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        noise_image(48, 48, seed=100 + i).save(docs / f"p{i:02}.png")
    db = tmp_path / "idx"
    proc = start_add(docs, db, tiny_embedding_checkpoint)
    deadline = time.monotonic() + 120
    while not (db / DATABASE).exists() or len(entries(db)) < 3:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no entries after 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 3 <= len(entries(db)) < 30  # killed part-way
    again = start_add(docs, db, tiny_embedding_checkpoint)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    done = entries(db)
    assert len(done) == 30 and len(set(done)) == 30  # every file once
    assert "already indexed" in err and "added" in err
    assert Store.open(db).graph().live == 30  # the graph caught up with the database


def test_search_json_and_rerank(indexed, tiny_reranker_checkpoint, capsys):
    docs, store, _ = indexed
    assert main(["index", "search", str(store.folder), "-i", str(docs / "img1.png"), "-k", "3", "--json",
                 *ENGINE_FLAGS]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"query", "images", "results"} and len(out["results"]) == 3
    assert all(set(r) == {"path", "page", "kind", "score"} for r in out["results"])
    assert out["results"][0]["path"] == str(docs.resolve() / "img1.png")
    assert main(["index", "search", str(store.folder), "a grey page", "-k", "2", "--json", "--rerank",
                 "--reranker", str(tiny_reranker_checkpoint), *ENGINE_FLAGS]) == 0
    reranked = json.loads(capsys.readouterr().out)["results"]
    assert len(reranked) == 2 and all(0 <= r["rerank_score"] <= 1 for r in reranked)
    assert reranked[0]["rerank_score"] >= reranked[1]["rerank_score"]


def test_another_model_or_width_is_refused_for_an_existing_index(indexed, tiny_reranker_checkpoint, capsys):
    docs, store, _ = indexed
    assert main(["index", "add", str(docs), "--db", str(store.folder), "--model", str(tiny_reranker_checkpoint)]) == 2
    assert "holds vectors of" in capsys.readouterr().err
    assert main(["index", "add", str(docs), "--db", str(store.folder), "--dimensions", "8"]) == 2
    assert "keeps" in capsys.readouterr().err


def test_without_faiss_the_index_names_the_extra(indexed, monkeypatch):
    _, store, _ = indexed
    monkeypatch.setitem(sys.modules, "faiss", None)
    reopened = Store.open(store.folder)  # the database opens; searching needs the graph
    assert reopened.counts()["entries"] == 6
    with pytest.raises(RuntimeError, match=r"qvl\[index\]"):
        reopened.search(np.zeros(reopened.dims, np.float32), 3)


@pytest.fixture(scope="module")
def client(indexed, tiny_embedding_checkpoint):
    _, store, _ = indexed
    settings = ServerSettings(max_body_bytes=2 * MB, images=ImagePolicy(max_bytes=MB, max_pixels=1_000_000))
    engine = fp32_engine(tiny_embedding_checkpoint)  # the server's worker alone drives it
    with TestClient(create_app(settings, lambda: engine, Store.open(store.folder))) as c:
        wait_ready(c)
        yield c


def test_server_search_answers_the_nearest_with_thumbnails(indexed, client):
    docs, _, _ = indexed
    query = [{"type": "image_url", "image_url": {"url": data_uri((docs / "img0.png").read_bytes())}}]
    r = client.post("/v1/search", json={"query": query, "k": 4})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 4 and results[0]["path"] == str(docs.resolve() / "img0.png")
    assert all(set(h) == {"path", "page", "kind", "score", "thumbnail"} for h in results)
    thumb = client.get(results[0]["thumbnail"])
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    second = client.get("/v1/index/thumbnail", params={"path": str(docs.resolve() / "sub/doc.pdf"), "page": 2})
    assert second.status_code == 200 and second.content[:2] == b"\xff\xd8"
    info = client.get("/v1/index").json()
    assert (info["entries"], info["files"]) == (6, 5)
    clip = client.get("/v1/index/thumbnail", params={"path": str(docs.resolve() / "sub/clip.mp4")})
    assert clip.status_code == 200 and clip.content[:2] == b"\xff\xd8"
    assert client.post("/v1/search", json={"query": "a grey page", "k": 2}).status_code == 200
    assert '<script id="qvl-index" type="application/json">true</script>' in client.get("/").text  # the search box
    assert_error(client.post("/v1/search", json={"query": "x", "k": 0}), 400, "k")


def test_thumbnails_are_confined_to_the_indexed_files(indexed, client):
    docs, _, _ = indexed
    root = docs.resolve()
    (root.parent / "secret.png").write_bytes((root / "img0.png").read_bytes())
    for path in (f"{root}/../secret.png", f"{root}/sub/../../secret.png", "/etc/passwd", "img0.png"):
        assert_error(client.get("/v1/index/thumbnail", params={"path": path}), 403, "path")
    assert_error(client.get("/v1/index/thumbnail", params={"path": f"{root}/broken.png"}), 404, "path")
    assert_error(client.get("/v1/index/thumbnail", params={"path": f"{root}/sub/doc.pdf", "page": 3}), 400, "page")
    assert client.get("/v1/index/thumbnail", params={"path": f"{root}/sub/../img1.png"}).status_code == 200



def test_server_search_reranks_its_candidates_when_asked(indexed, tiny_embedding_checkpoint, tiny_reranker_checkpoint):
    """`qvl serve --index --reranker`: a search with rerank scores the nearest `candidates`
    with the reranker and answers the best k by that score, as `qvl index search --rerank` does."""
    _, store, _ = indexed
    embedder, reranker = fp32_engine(tiny_embedding_checkpoint), fp32_engine(tiny_reranker_checkpoint)
    sources = [ModelSource(lambda: embedder, "emb", EngineOptions(model=str(tiny_embedding_checkpoint))),
               ModelSource(lambda: reranker, "rr", EngineOptions(model=str(tiny_reranker_checkpoint)))]
    settings = ServerSettings(max_body_bytes=2 * MB, images=ImagePolicy(max_bytes=MB, max_pixels=1_000_000))
    query = [{"type": "text", "text": "a grey page"}]
    nearest = search(embedder, Store.open(store.folder), query, k=6)  # before the server's worker drives them
    expected = reranked(reranker, query, nearest)  # the CLI's order
    with TestClient(create_app(settings, sources, Store.open(store.folder), "rr")) as c:
        assert c.get("/v1/index").json()["reranker"] == "rr"
        r = c.post("/v1/search", json={"query": "a grey page", "k": 2, "rerank": True, "candidates": 6})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [(h["path"], h["page"]) for h in results] == [(h.path, h.page) for h, _ in expected[:2]]
        np.testing.assert_allclose([h["rerank_score"] for h in results], [s for _, s in expected[:2]], atol=1e-5)
        plain = c.post("/v1/search", json={"query": "a grey page", "k": 2}).json()["results"]
        assert [(h["path"], h["page"]) for h in plain] == [(h.path, h.page) for h in nearest[:2]]
        assert all("rerank_score" not in h for h in plain)


def test_rerank_on_a_server_without_a_reranker_is_refused(client):
    assert client.get("/v1/index").json()["reranker"] is None
    error = assert_error(client.post("/v1/search", json={"query": "x", "rerank": True}), 400, "rerank")
    assert "--reranker" in error["message"]


def test_serve_reranker_is_added_once_and_must_be_a_reranker(tiny_embedding_checkpoint, tiny_reranker_checkpoint):
    emb, rr = str(tiny_embedding_checkpoint), str(tiny_reranker_checkpoint)
    assert with_reranker([(None, emb)], rr) == ([(None, emb), (None, rr)], Path(rr).resolve().name)
    assert with_reranker([(None, emb)], f"judge={rr}") == ([(None, emb), ("judge", rr)], "judge")
    assert with_reranker([(None, emb), ("judge", rr)], rr) == ([(None, emb), ("judge", rr)], "judge")  # served already
    with pytest.raises(UsageError, match="not a reranker"):
        with_reranker([(None, emb)], emb)
    assert main(["serve", "--reranker", rr, "--model", emb]) == 2  # nothing to rerank without --index
