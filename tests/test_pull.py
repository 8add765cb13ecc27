"""Models by name against a local mirror of the hub's file API serving a synthetic checkpoint:
`qvl pull` by short name into the Hugging Face cache ($HF_HOME, $HF_ENDPOINT), resumed after a
dropped connection and after the process was killed, checksums enforced; `qvl list` and
`qvl rm`; a pulled model answers `qvl ask` offline; Ollama's /api/pull and /api/delete.
In-process tests point this process's huggingface_hub at the mirror (the `hub` fixture)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import qvl
from qvl.cli import main
from qvl.models import hub_id, local_models, preset_of
from qvl.pull import ChecksumError, pull
from qvl.server.app import create_app
from qvl.server.settings import ServerSettings
from tests.hub_mirror import COMMIT, HubMirror
from tests.test_server_api import wait_ready

REPO = "Qwen/Qwen3-VL-2B-Instruct"
SRC = str(Path(qvl.__file__).parents[1])
WEIGHTS = "model.safetensors"


def hub_env(tmp_path: Path, mirror: HubMirror, **extra) -> dict:
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": mirror.url, "QVL_CACHE_DIR":
            str(tmp_path / "qvl"), "PYTHONPATH": SRC, "QVL_NATIVE": "0", "HF_HUB_OFFLINE": "0", **extra}


def qvl_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qvl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def listed(env: dict) -> list[dict]:
    out = qvl_cli(env, "list", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def blob(tmp_path: Path, data: bytes) -> Path:
    return tmp_path / "hf/hub/models--Qwen--Qwen3-VL-2B-Instruct/blobs" / hashlib.sha256(data).hexdigest()


def test_short_names_stand_for_hub_ids():
    assert hub_id("qwen3-vl:2b") == REPO and hub_id("Qwen3.5:9B") == "Qwen/Qwen3.5-9B"
    assert hub_id("qwen3.6:35b-a3b") == "Qwen/Qwen3.6-35B-A3B" and hub_id("qwen3-vl:8b-thinking").endswith("Thinking")
    assert hub_id(f"{REPO}:latest") == REPO == hub_id(REPO)
    with pytest.raises(ValueError, match="qwen3-vl:2b"):
        hub_id("llama3")
    assert preset_of("qwen3.5:9b") == preset_of("Qwen/Qwen3.5-9B") == "qwen3.5-9b"  # `qvl info --model` sizes it


@pytest.mark.slow
def test_pull_by_short_name_then_list_ask_offline_and_rm(tiny_checkpoint, tmp_path):
    """The whole round as a user runs it, HF_HOME and HF_ENDPOINT read from the environment."""
    with HubMirror(REPO, tiny_checkpoint, extra={"README.md": b"# not a model file"}) as mirror:
        env = hub_env(tmp_path, mirror)
        out = qvl_cli(env, "pull", "qwen3-vl:2b")
        assert out.returncode == 0, out.stderr
        assert mirror.gets("README.md") == []
    weights = (tiny_checkpoint / WEIGHTS).read_bytes()
    assert blob(tmp_path, weights).read_bytes() == weights
    [model] = listed(env)
    served = sum(f.stat().st_size for f in tiny_checkpoint.iterdir())
    assert (model["name"], model["short"], model["formats"], model["size"]) == (REPO, "qwen3-vl:2b", ["bf16"], served)
    assert model["last_used"] is None

    offline = {**env, "HF_HUB_OFFLINE": "1"}  # and the mirror is gone
    out = qvl_cli(offline, "ask", "--model", "qwen3-vl:2b", "Hi", "--max-new-tokens", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["completion_tokens"] == 2
    [model] = listed(offline)
    assert model["formats"] == ["bf16", "int8"] and time.time() - model["last_used"] < 120
    assert model["size"] > served  # the int8 copy counts

    out = qvl_cli(offline, "rm", "qwen3-vl:2b")
    assert out.returncode == 0 and out.stdout.startswith("removed qwen3-vl:2b"), out.stderr
    assert listed(offline) == [] and not list((tmp_path / "qvl/quantized").glob(f"{COMMIT}-*"))
    again = qvl_cli(offline, "rm", "qwen3-vl:2b")
    assert again.returncode == 1 and "not in the Hugging Face cache" in again.stderr


@pytest.fixture
def hub(tiny_checkpoint, tmp_path, monkeypatch):
    """This process's huggingface_hub pointed at a mirror and an empty cache, as HF_ENDPOINT
    and HF_HOME would at its start."""
    from huggingface_hub import constants

    with HubMirror(REPO, tiny_checkpoint) as mirror:
        monkeypatch.setattr(constants, "ENDPOINT", mirror.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", mirror.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        mirror.cache = constants.HF_HUB_CACHE
        yield mirror


def partial_of(path: Path) -> Path:
    return path.with_name(path.name + ".incomplete")


def test_a_dropped_connection_resumes_from_the_bytes_written(hub, tmp_path):
    hub.cut[WEIGHTS] = 10_000_000
    steps = []
    path = pull("qwen3-vl:2b", steps.append)
    assert hub.gets(WEIGHTS) == [None, "bytes=10000000-"]  # the second request asked for the rest only
    assert (path / WEIGHTS).read_bytes() == (hub.folder / WEIGHTS).read_bytes()
    assert [s.status for s in steps if s.file == WEIGHTS][-1] == "verifying"
    assert [m.name for m in local_models()] == [REPO] and not list(Path(hub.cache).rglob("*.incomplete"))


def test_a_killed_pull_resumes_where_it_stopped(hub, tmp_path):
    weights = (hub.folder / WEIGHTS).read_bytes()
    partial = partial_of(Path(hub.cache) / "models--Qwen--Qwen3-VL-2B-Instruct/blobs" /
                         hashlib.sha256(weights).hexdigest())
    hub.stall[WEIGHTS] = 20_000_000
    env = {**os.environ, "HF_HUB_CACHE": hub.cache, "HF_ENDPOINT": hub.url, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "0"}
    # SIGINT at its default in the child, so Python turns it into KeyboardInterrupt even when the
    # tests run in a background job (whose shell starts them with SIGINT ignored, inherited)
    first = subprocess.Popen([sys.executable, "-m", "qvl.cli", "pull", REPO], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size == 20_000_000):
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)  # Ctrl-C halfway through the weights
    assert first.wait(30) == 130
    hub.release.set()
    assert local_models() == []  # half a model is no model
    pull(REPO)
    assert hub.gets(WEIGHTS)[-1] == "bytes=20000000-"
    assert partial.with_suffix("").read_bytes() == weights and not partial.exists()
    assert [m.name for m in local_models()] == [REPO]


def test_a_corrupted_download_is_refused_and_not_kept(hub):
    hub.corrupt.add(WEIGHTS)
    with pytest.raises(ChecksumError, match="model.safetensors: checksum mismatch"):
        pull(REPO)
    kept = Path(hub.cache) / "models--Qwen--Qwen3-VL-2B-Instruct/blobs" / hub.files[WEIGHTS].etag
    assert not kept.exists() and not partial_of(kept).exists()
    assert local_models() == []
    hub.corrupt.clear()
    assert (pull(REPO) / WEIGHTS).read_bytes() == (hub.folder / WEIGHTS).read_bytes()


def test_pull_errors_say_what_is_wrong(hub, monkeypatch, capsys):
    from huggingface_hub import constants

    assert main(["pull", "Qwen/No-Such-Model"]) == 1
    assert "no such model on the hub" in capsys.readouterr().err
    assert main(["pull", "llama3"]) == 1
    assert "unknown model name 'llama3'" in capsys.readouterr().err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["pull", REPO]) == 1
    assert "offline mode" in capsys.readouterr().err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert main(["pull", REPO]) == 0
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(hub.requests)
    assert main(["pull", REPO]) == 0  # already here: nothing to fetch
    assert len(hub.requests) == before
    assert main(["rm", "qwen3-vl:2b", "Qwen/Never-Pulled"]) == 1
    assert "'Qwen/Never-Pulled' is not in the Hugging Face cache" in capsys.readouterr().err
    assert local_models() == []


def test_ollama_pull_streams_progress_and_delete_removes(hub, tiny_engine):
    with TestClient(create_app(ServerSettings(), lambda: tiny_engine)) as client:
        wait_ready(client)
        with client.stream("POST", "/api/pull", json={"model": "qwen3-vl:2b"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in r.iter_lines() if line]
        statuses = [line["status"] for line in lines]
        assert statuses[0] == "pulling manifest" and statuses[-2:] == ["writing manifest", "success"]
        size = (hub.folder / WEIGHTS).stat().st_size
        digest = "sha256:" + hashlib.sha256((hub.folder / WEIGHTS).read_bytes()).hexdigest()
        weights = [line for line in lines if line.get("digest") == digest]
        assert weights[0]["status"] == f"pulling {digest[7:19]}" and weights[-1]["status"] == "verifying sha256 digest"
        done = [line["completed"] for line in weights if "completed" in line]
        assert done == sorted(done) and done[-1] == size and weights[0]["total"] == size

        assert client.post("/api/pull", json={"model": REPO, "stream": False}).json() == {"status": "success"}
        refused = client.post("/api/pull", json={"model": "llama3"})
        assert refused.status_code == 400 and "unknown model name" in refused.json()["error"]
        failed = client.post("/api/pull", json={"model": "Qwen/Nothing"})
        assert failed.status_code == 200 and "no such model" in failed.text.splitlines()[-1]

        assert client.request("DELETE", "/api/delete", json={"model": "qwen3-vl:2b"}).status_code == 200
        gone = client.request("DELETE", "/api/delete", json={"model": "qwen3-vl:2b"})
        assert gone.status_code == 404 and gone.json() == {"error": "model 'qwen3-vl:2b' not found"}
