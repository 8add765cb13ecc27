"""Several models in one server, over HTTP on tiny checkpoints: requests routed by `model` on
every API family, 404 naming the models served, loading on first request (concurrent requests
share one load), keep_alive 0 and --max-loaded / --max-memory unloading the least recently used
idle model (never one that is generating), a failed load answered with its reason while the
others keep serving, /v1/models, /api/tags and /api/ps telling the truth, the web page's picker."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from tests.test_server_support import free_port

from qvl.engine import Engine, EngineOptions
from qvl.server.app import create_app
from qvl.server.registry import ModelSource, expected_bytes
from qvl.server.serve import config
from qvl.server.settings import ModelLimits, ServerSettings

HELLO = [{"role": "user", "content": "hello"}]


def source(path, name: str) -> ModelSource:
    return ModelSource.of(EngineOptions(model=str(path), threads=2, weights="fp32", dtype="fp32"), name)


def app_of(*sources: ModelSource, **limits):
    return create_app(ServerSettings(warm_up=False, models=ModelLimits(**limits)), list(sources))


def chat(client, model: str | None, **extra) -> httpx.Response:
    body = {"messages": HELLO, "max_tokens": 2, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body if model is None else {**body, "model": model})


def loaded(client) -> list[str]:
    return sorted(m["name"] for m in client.get("/api/ps").json()["models"])


def wait_for(check, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextlib.contextmanager
def serving(app):
    """The app under uvicorn in this process (real streaming and disconnects), at its URL."""
    server = uvicorn.Server(config(app, "127.0.0.1", free_port(), "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def broken_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("broken")
    (folder / "config.json").write_text('{"model_type": "qwen3_vl", "text_config": ')  # cut short
    return folder


def test_routing_by_name_on_every_api_family(tiny_checkpoint, tiny_untied_checkpoint, tiny_embedding_checkpoint):
    app = app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"),
                 source(tiny_embedding_checkpoint, "emb"))
    with TestClient(app) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a", "b", "emb"]
        assert loaded(c) == []  # nothing loads before it is asked for
        assert chat(c, "b").json()["model"] == "b"
        assert loaded(c) == ["b:latest"]
        assert chat(c, "A").json()["model"] == "a"  # names are matched without case
        assert chat(c, None).json()["model"] == "a"  # no model: the first one
        response = c.post("/v1/responses", json={"model": "b", "input": "hi", "max_output_tokens": 2}).json()
        assert response["model"] == "b"
        ollama = {"messages": HELLO, "stream": False, "options": {"num_predict": 2}}
        assert c.post("/api/chat", json={**ollama, "model": "a:latest"}).json()["model"] == "a"
        generated = c.post("/api/generate", json={"model": "b", "prompt": "hi", "stream": False,
                                                  "options": {"num_predict": 2}}).json()
        assert generated["model"] == "b" and generated["done"]
        shown = c.post("/api/show", json={"model": "b"}).json()
        assert shown["model_info"]["general.basename"] == "b" and shown["model_info"]["qwen3vl.block_count"] == 3
        assert c.post("/v1/embeddings", json={"model": "emb", "input": "hi"}).status_code == 200
        assert c.post("/api/embed", json={"model": "emb", "input": ["hi", "yo"]}).json()["model"] == "emb"
        wrong = c.post("/v1/embeddings", json={"model": "a", "input": "hi"})  # a chat model
        assert wrong.status_code == 400 and "model a is a chat model" in wrong.json()["error"]["message"]
        assert loaded(c) == ["a:latest", "b:latest", "emb:latest"]


def test_unknown_model_is_404_naming_the_known_ones(tiny_checkpoint, tiny_untied_checkpoint):
    with TestClient(app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"))) as c:
        error = chat(c, "gpt-4o").json()["error"]
        assert chat(c, "gpt-4o").status_code == 404
        assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"] == "not_found_error"
        assert "'gpt-4o'" in error["message"] and "a, b" in error["message"]
        ollama = c.post("/api/chat", json={"model": "llama3", "messages": HELLO})
        assert ollama.status_code == 404 and set(ollama.json()) == {"error"} and "a, b" in ollama.json()["error"]
        for path, body in (("/v1/embeddings", {"input": "x"}), ("/api/show", {}), ("/v1/responses", {"input": "x"})):
            assert c.post(path, json={**body, "model": "nope"}).status_code == 404
        assert loaded(c) == []


def test_a_single_model_server_answers_every_name(tiny_engine):
    own = [{"role": "user", "content": "which model are you?"}]  # the shared engine caches answers: not HELLO's
    with TestClient(create_app(ServerSettings(warm_up=False), lambda: tiny_engine)) as c:
        wait_for(lambda: c.get("/health").status_code == 200)
        assert chat(c, "gpt-4o", messages=own).status_code == 200
        assert c.post("/api/chat", json={"model": "llama3", "messages": own, "stream": False,
                                         "options": {"num_predict": 1}}).status_code == 200


def test_tags_and_ps_say_what_is_on_disk_and_what_is_loaded(tiny_checkpoint, tiny_untied_checkpoint):
    with TestClient(app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"))) as c:
        health = c.get("/health").json()
        assert health == {"status": "ok", "models": [{"name": "a", "loaded": False}, {"name": "b", "loaded": False}]}
        tags = {m["name"]: m for m in c.get("/api/tags").json()["models"]}
        on_disk = sum(f.stat().st_size for f in tiny_untied_checkpoint.glob("*.safetensors"))
        assert set(tags) == {"a:latest", "b:latest"} and tags["b:latest"]["size"] == on_disk
        assert tags["b:latest"]["details"]["family"] == "qwen3vl"
        assert tags["b:latest"]["details"]["quantization_level"] == "FLOAT32"
        assert c.get("/api/ps").json() == {"models": []}
        assert chat(c, "b").status_code == 200
        (ps,) = c.get("/api/ps").json()["models"]
        engine = c.app.state.qvl.models.models[1].engine
        assert ps["name"] == "b:latest" and ps["digest"] == tags["b:latest"]["digest"]
        assert ps["details"] == tags["b:latest"]["details"]
        assert ps["size"] >= sum(p.numel() * 4 for p in engine.model.parameters())  # fp32 weights, at least
        assert ps["expires_at"].startswith("9999")  # no --keep-alive here: kept loaded
        assert c.get("/health").json()["models"][1] == {"name": "b", "loaded": True}


def test_keep_alive_zero_unloads_and_frees_the_model(tiny_checkpoint, tiny_untied_checkpoint):
    with TestClient(app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"))) as c:
        registry = c.app.state.qvl.models
        load = {"model": "a", "stream": False}
        assert c.post("/api/generate", json=load).json()["done_reason"] == "load"  # Ollama's preload: no prompt
        assert loaded(c) == ["a:latest"]
        engine = weakref.ref(registry.models[0].engine)
        answer = c.post("/api/generate", json={**load, "prompt": "hi", "keep_alive": 0, "options": {"num_predict": 2}})
        assert answer.status_code == 200 and answer.json()["done"]
        wait_for(lambda: engine() is None)  # nothing holds the unloaded model: its memory went back
        assert loaded(c) == []
        bad = c.post("/api/chat", json={"model": "b", "messages": HELLO, "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
        assert c.post("/api/chat", json={"model": "b", "messages": HELLO, "keep_alive": "1s", "stream": False,
                                         "options": {"num_predict": 1}}).status_code == 200
        assert loaded(c) == ["b:latest"]
        wait_for(lambda: loaded(c) == [], 10)  # one second after its answer
        assert c.post("/api/generate", json={"model": "b", "keep_alive": 0}).json()["done_reason"] == "unload"


def test_max_loaded_unloads_the_least_recently_used(tiny_checkpoint, tiny_untied_checkpoint, tiny35_checkpoint):
    app = app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"), source(tiny35_checkpoint, "c"),
                 max_loaded=2)
    with TestClient(app) as c:
        for name in ("a", "b", "a", "c"):
            assert chat(c, name).status_code == 200
        assert loaded(c) == ["a:latest", "c:latest"]  # b was the least recently used


def test_max_memory_unloads_an_idle_model_to_fit(tiny_checkpoint, tiny_untied_checkpoint):
    a, b = source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b")
    with TestClient(app_of(a, b)) as probe:  # the budget: room for one model, not two
        one = expected_bytes(probe.app.state.qvl.models.models[0])
    with TestClient(app_of(a, b, max_memory_bytes=int(1.5 * one))) as c:
        assert chat(c, "a").status_code == 200 and chat(c, "b").status_code == 200
        assert loaded(c) == ["b:latest"]


def test_a_generating_model_is_never_unloaded_for_another(tiny_checkpoint, tiny_untied_checkpoint):
    """--max-loaded 1: a request for b waits while a streams, and is answered once a's
    client leaves (then a is unloaded, b loaded)."""
    with serving(app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"), max_loaded=1)) as url:
        other: dict = {}
        with httpx.Client(base_url=url, timeout=60) as c:
            body = {"model": "a", "messages": HELLO, "max_tokens": 20000, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if '"content":"' in line and '"content":""' not in line)  # generating
                waiting = threading.Thread(target=lambda: other.update(r=chat(httpx.Client(base_url=url, timeout=60), "b")))
                waiting.start()
                time.sleep(1.0)
                assert waiting.is_alive() and loaded(c) == ["a:latest"]
                next(lines)  # a still streams
            waiting.join(60)
            assert other["r"].status_code == 200 and other["r"].json()["model"] == "b"
            assert loaded(c) == ["b:latest"]


def test_no_room_while_every_model_is_busy_is_a_503_naming_them(tiny_checkpoint, tiny_untied_checkpoint):
    settings = ServerSettings(warm_up=False, time_limit_s=1.0, models=ModelLimits(max_loaded=1))
    with TestClient(create_app(settings, [source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b")])) as c:
        held = c.portal.call(c.app.state.qvl.models.acquire, "a")  # a request holding a
        busy = chat(c, "b")  # waits the request time limit for a to be let go
        error = busy.json()["error"]
        assert busy.status_code == 503 and error["code"] == "models_busy" and busy.headers["retry-after"]
        assert "--max-loaded is 1" in error["message"] and "(a)" in error["message"]
        assert loaded(c) == ["a:latest"]
        c.portal.call(held.release)
        assert chat(c, "b").status_code == 200 and loaded(c) == ["b:latest"]


def test_requests_share_one_load_and_a_failed_load_leaves_the_others_serving(tiny_checkpoint, broken_checkpoint):
    loads = []

    def counted_load():
        loads.append(1)
        time.sleep(0.5)  # the second request arrives during the load
        return Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, weights="fp32", dtype="fp32", name="a"))

    app = app_of(ModelSource(counted_load, "a"), source(broken_checkpoint, "broken"))
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        results: list = [None] * 4
        names = ["a", "a", "broken", "broken"]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, chat(c, names[i]))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200, 503, 503] and len(loads) == 1
        error = results[2].json()["error"]
        assert error["code"] == "model_load_failed" and "'broken'" in error["message"]
        assert "JSONDecodeError" in error["message"]
        ollama = c.post("/api/chat", json={"model": "broken", "messages": HELLO})
        assert ollama.status_code == 503 and "'broken' failed to load" in ollama.json()["error"]
        assert chat(c, "a").status_code == 200  # the other model kept serving
        health = c.get("/health").json()["models"]
        assert health[0] == {"name": "a", "loaded": True} and "JSONDecodeError" in health[1]["error"]
        tags = {m["name"]: m for m in c.get("/api/tags").json()["models"]}
        assert tags["broken:latest"]["details"]["family"] == ""  # listed, with what its files can tell
        assert loaded(c) == ["a:latest"]


def test_web_page_has_a_model_picker(tiny_checkpoint, tiny_untied_checkpoint):
    with TestClient(app_of(source(tiny_checkpoint, "a"), source(tiny_untied_checkpoint, "b"))) as c:
        page = c.get("/").text
        assert '<select id="model"' in page
        script = c.get("/static/app.js").text
        assert 'fetch("v1/models"' in script and "body.model = $(\"model\").value" in script


def test_serve_arguments_for_several_models(tmp_path):
    from qvl.cli import build_parser
    from qvl.server.cli import served_models, settings

    for name in ("x", "y"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--model", "fast=Qwen/Qwen3-VL-2B-Instruct", "--model", "./a=b",
                              "--models", str(tmp_path), "--max-loaded", "2", "--max-memory", "12G"])
    assert served_models(args) == [("fast", "Qwen/Qwen3-VL-2B-Instruct"), (None, "./a=b"),
                                   (None, str(tmp_path / "x")), (None, str(tmp_path / "y"))]
    limits = settings(args).models
    assert limits.keep_alive_s == 300 and limits.max_loaded == 2 and limits.max_memory_bytes == 12 * 2**30
    assert settings(parser.parse_args(["serve"])).models.keep_alive_s is None  # one model: kept loaded
    assert settings(parser.parse_args(["serve", "--keep-alive", "1h30m"])).models.keep_alive_s == 5400
    with pytest.raises(ValueError, match="keep_alive"):
        settings(parser.parse_args(["serve", "--keep-alive", "soon"]))
    with pytest.raises(ValueError, match="two models are called x"):
        app_of(source(tmp_path / "x", "x"), source(tmp_path / "y", "X"))


def test_keep_alive_durations():
    from qvl.server.settings import byte_size, keep_alive_s

    assert [keep_alive_s(v) for v in ("5m", "1h30m", "90", 90, "0", 0, "-1", -1, "2.5s", "300ms")] == \
        [300, 5400, 90, 90, 0, 0, None, None, 2.5, 0.3]
    for bad in ("soon", "5 minutes", True, None, float("inf")):
        with pytest.raises(ValueError):
            keep_alive_s(bad)
    assert byte_size("12G") == 12 * 2**30 and byte_size("512MiB") == 2**29 and byte_size("1000") == 1000
    with pytest.raises(ValueError):
        byte_size("lots")


def test_an_index_is_searched_with_its_own_model(tmp_path):
    from types import SimpleNamespace

    from qvl.options import UsageError
    from qvl.server.cli import with_index_model

    (tmp_path / "embedder").mkdir()
    index = SimpleNamespace(meta={"model": str(tmp_path / "embedder")}, folder=tmp_path / "my.index")  # Store's fields
    assert with_index_model(index, [(None, None)]) == [(None, str(tmp_path / "embedder"))]  # no --model: its own
    several = [("chat", "Qwen/Qwen3-VL-2B-Instruct"), ("embed", str(tmp_path / "embedder"))]
    assert with_index_model(index, several) == several
    with pytest.raises(UsageError, match="none of the --model"):
        with_index_model(index, [("a", "Org/A"), ("b", "Org/B")])
    with pytest.raises(UsageError, match="would make vectors"):
        with_index_model(index, [(None, "Org/A")])
