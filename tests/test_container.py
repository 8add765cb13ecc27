"""The container's entry script, run outside a container (no image builder here): the kernels the
image build compiles seed the cache volume and are not compiled again, a model folder is served
on all interfaces and /health answers, SIGTERM stops it after a graceful shutdown; other arguments run qvl's
subcommands."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import qvl

ROOT = Path(qvl.__file__).parents[2]
ENTRY = ROOT / "docker/entrypoint.sh"
MARK = b"qvl: built with the image"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dockerfile_runs_the_entry_script_and_builds_the_kernels_it_seeds():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY docker/entrypoint.sh /usr/local/bin/qvl-entrypoint" in dockerfile
    assert 'ENTRYPOINT ["qvl-entrypoint"]' in dockerfile and "USER qvl" in dockerfile
    assert "QVL_CACHE_DIR=/opt/qvl qvl info" in dockerfile  # /opt/qvl/native: the entry script's default
    assert "/opt/qvl/native" in ENTRY.read_text()


@pytest.mark.slow
def test_entry_script_seeds_kernels_and_serves(tiny_checkpoint, tmp_path):
    env = {**os.environ, "PATH": f"{Path(os.sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "src")}
    env.pop("QVL_NATIVE", None)
    image = {**env, "QVL_CACHE_DIR": str(tmp_path / "image")}
    subprocess.run(["qvl", "info"], env=image, check=True, capture_output=True, timeout=900)  # the image build
    [built] = (tmp_path / "image/native").glob("*.so")
    with open(built, "ab") as f:  # trailing bytes the loader ignores: tell the image's copy from a rebuild
        f.write(MARK)

    volume = {**env, "QVL_CACHE_DIR": str(tmp_path / "volume/qvl"), "HF_HOME": str(tmp_path / "volume/hf"),
              "QVL_PREBUILT_KERNELS": str(tmp_path / "image/native"), "QVL_MODEL": str(tiny_checkpoint),
              "QVL_PORT": str(port := free_port())}
    server = subprocess.Popen(["sh", str(ENTRY), "serve", "--no-warm-up"], env=volume,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        assert (tmp_path / "volume/qvl/native" / built.name).read_bytes().endswith(MARK)  # seeded, not rebuilt
    finally:
        server.send_signal(signal.SIGTERM)
        out = server.communicate(timeout=60)[0]
    assert server.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in out, out[-3000:]
    assert re.search(r"^kernels\s+\S", out, re.M)  # the entry script said which build runs

    listed = subprocess.run(["sh", str(ENTRY), "list"], env=volume, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and listed.stdout.startswith("NAME"), listed.stderr
