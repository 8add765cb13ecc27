"""Kill `qvl batch` part-way (SIGINT, SIGKILL), run it again: exactly one valid row per item."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.test_batch_cli import qvl_batch, read_rows, write_images

pytestmark = pytest.mark.slow  # `qvl batch` subprocesses killed and run again

ITEMS = 10
ARGS = ("--prompt", "Describe the image.", "--max-new-tokens", "32", "--temperature", "0", "--batch-size", "2")


def start(checkpoint, folder, out) -> subprocess.Popen:
    argv = [sys.executable, "-m", "qvl.cli", "batch", str(folder), "--out", str(out), *ARGS,
            "--model", str(checkpoint), "--threads", "1", "--dtype", "fp32"]
    # SIGINT at its default in the child, so Python turns it into KeyboardInterrupt even when these
    # tests run in a background job (whose shell starts them with SIGINT ignored, inherited)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_rows(out, proc, rows: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= rows:
            return
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.02)
    raise AssertionError(f"fewer than {rows} rows after {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_run_resumes_without_duplicates_or_losses(tiny_checkpoint, tmp_path, sig):
    folder = tmp_path / "images"
    ids = write_images(folder, ITEMS)
    out = tmp_path / "results.jsonl"
    proc = start(tiny_checkpoint, folder, out)
    wait_for_rows(out, proc, 2)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, stderr
        assert "interrupted: done" in stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    before = out.read_bytes()
    assert 2 <= before.count(b"\n") < ITEMS, "the kill should land part-way"
    kept = before[: before.rfind(b"\n") + 1]
    with open(out, "ab") as f:  # what a kill in the middle of a write would leave behind
        f.write(b'{"id": "img00.png", "image": "cut here')

    again = qvl_batch(tiny_checkpoint, folder, "--out", out, *ARGS)
    assert again.returncode == 0, again.stderr
    assert "removed a truncated last line" in again.stderr
    assert out.read_bytes().startswith(kept)  # earlier rows untouched
    rows = read_rows(out)  # every line is valid JSON
    assert sorted(r["id"] for r in rows) == ids  # exactly one row per item
    assert all("text" in r and "error" not in r for r in rows)
