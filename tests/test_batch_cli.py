"""`qvl batch` end to end on the tiny checkpoint: broken files, resume, --retry-errors,
batched == one-at-a-time, JSONL input, usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from qvl.batch.output import ResultsFile
from qvl.cli import main

BROKEN = {"broken.jpg": b"this is not a jpeg", "empty.png": b""}


def write_images(folder: Path, count: int, broken: bool = False) -> list[str]:
    """`count` small noise images (every other one in sub/), plus two broken files; returns ids."""
    ids = []
    for i in range(count):
        rel = f"sub/img{i:02d}.png" if i % 2 else f"img{i:02d}.png"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        pixels = np.random.RandomState(i).rand(48 + 16 * (i % 3), 64, 3) * 255
        Image.fromarray(pixels.astype("uint8")).save(folder / rel)
        ids.append(rel)
    if broken:
        for name, data in BROKEN.items():
            (folder / name).write_bytes(data)
            ids.append(name)
    (folder / "notes.txt").write_text("not an image, not an item")
    return sorted(ids)


def qvl_batch(checkpoint, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "qvl.cli", "batch", *map(str, args), "--model", str(checkpoint),
            "--threads", "1", "--dtype", "fp32"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    return folder, write_images(folder, 5, broken=True)


@pytest.mark.slow  # `qvl batch` subprocesses
def test_broken_files_become_error_rows_and_rerun_resumes(tiny_checkpoint, images, tmp_path):
    folder, ids = images
    out = tmp_path / "results.jsonl"
    first = qvl_batch(tiny_checkpoint, folder, "--out", out, "--task", "ocr", "--max-new-tokens", "6")
    assert first.returncode == 1, first.stderr  # some items failed
    assert "done 5, failed 2, skipped 0" in first.stderr
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ids
    by_id = {r["id"]: r for r in rows}
    for name in BROKEN:
        assert set(by_id[name]) == {"id", "image", "prompt", "error"}
        assert "not a recognised image format" in by_id[name]["error"]
    good = by_id["sub/img01.png"]
    assert set(good) == {"id", "image", "prompt", "text", "finish_reason", "usage", "timings"}
    assert good["image"] == str(folder / "sub/img01.png") and good["usage"]["completion_tokens"] <= 6

    again = qvl_batch(tiny_checkpoint, folder, "--out", out, "--task", "ocr", "--max-new-tokens", "6")
    assert again.returncode == 1 and "skipped 7" in again.stderr and "--retry-errors" in again.stderr
    assert read_rows(out) == rows  # nothing rewritten, nothing added

    retry = qvl_batch(tiny_checkpoint, folder, "--out", out, "--task", "ocr", "--max-new-tokens", "6",
                      "--retry-errors")
    assert retry.returncode == 1 and "removed 2 error row(s)" in retry.stderr and "failed 2, skipped 5" in retry.stderr
    assert sorted(r["id"] for r in read_rows(out)) == ids


@pytest.mark.slow  # `qvl batch` subprocesses
def test_batched_rows_match_one_at_a_time(tiny_checkpoint, images, tmp_path):
    folder, ids = images
    runs = {}
    for size in (1, 4):
        out = tmp_path / f"bs{size}.jsonl"
        r = qvl_batch(tiny_checkpoint, folder, "--out", out, "--prompt", "Describe.", "--temperature", "0",
                      "--max-new-tokens", "12", "--batch-size", size)
        assert r.returncode == 1, r.stderr
        runs[size] = {row["id"]: row for row in read_rows(out)}
    assert sorted(runs[1]) == sorted(runs[4]) == ids
    for item in ids:
        one, four = runs[1][item], runs[4][item]
        assert (one.get("text"), one.get("finish_reason"), one.get("error")) == \
               (four.get("text"), four.get("finish_reason"), four.get("error")), item
        assert one.get("usage") == four.get("usage")


def test_jsonl_input_with_own_prompts(tiny_checkpoint, images, tmp_path):
    folder, _ = images
    job = tmp_path / "job.jsonl"
    rows = [{"id": "first", "image": str(folder / "img00.png"), "prompt": "What is this?"},
            {"id": "second", "image": str(folder / "sub/img01.png")}]
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.jsonl"
    r = qvl_batch(tiny_checkpoint, job, "--out", out, "--prompt", "Default prompt.", "--max-new-tokens", "3",
                  "--progress-every", "0")
    assert r.returncode == 0, r.stderr
    assert {row["id"]: row["prompt"] for row in read_rows(out)} == {"first": "What is this?",
                                                                    "second": "Default prompt."}
    assert "2/2 items (0 failed)" in r.stderr  # plain progress lines when stderr is not a terminal


@pytest.mark.parametrize("case", ["no_prompt", "duplicate_ids", "missing_input", "bad_batch_size"])
def test_usage_errors_exit_2_with_one_line(tiny_checkpoint, images, tmp_path, capsys, case):
    folder, _ = images
    job = tmp_path / "job.jsonl"
    job.write_text('{"id": "x", "image": "a.png", "prompt": "p"}\n{"id": "x", "image": "b.png", "prompt": "p"}\n')
    args = {
        "no_prompt": [folder],
        "duplicate_ids": [job],
        "missing_input": [tmp_path / "nope", "--task", "ocr"],
        "bad_batch_size": [folder, "--task", "ocr", "--batch-size", "0"],
    }[case]
    assert main(["batch", *map(str, args), "--out", str(tmp_path / "out.jsonl"), "--model", str(tiny_checkpoint)]) == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qvl batch: error:"), stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_ray_without_ray_says_how_to_install(tiny_checkpoint, images, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    folder, _ = images
    assert main(["batch", str(folder), "--out", str(tmp_path / "out.jsonl"), "--task", "ocr", "--ray"]) == 2
    assert "pip install 'qvl[ray]'" in capsys.readouterr().err


def batch(tiny_checkpoint, *args) -> int:
    return main(["batch", *map(str, args), "--model", str(tiny_checkpoint), "--task", "ocr"])


def test_batch_refuses_to_write_into_its_input(tiny_checkpoint, tmp_path, capsys):
    job = tmp_path / "jobs.jsonl"
    job.write_text("".join(json.dumps({"id": f"n{i}", "image": f"{i}.png"}) + "\n" for i in range(3)))
    before = job.read_bytes()
    assert batch(tiny_checkpoint, job, "--out", job) == 2
    assert "is the input" in capsys.readouterr().err
    link = tmp_path / "same.jsonl"  # the same file under another name
    os.link(job, link)
    assert batch(tiny_checkpoint, job, "--out", link) == 2
    image = tmp_path / "photo.png"
    image.write_bytes(b"\x89PNG")
    assert batch(tiny_checkpoint, image, "--out", image) == 2
    assert "is the input" in capsys.readouterr().err
    assert job.read_bytes() == before and image.read_bytes() == b"\x89PNG"


def test_batch_exits_2_when_out_cannot_be_written(tiny_checkpoint, tmp_path, capsys):
    image = tmp_path / "photo.png"
    image.write_bytes(b"\x89PNG")
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert batch(tiny_checkpoint, image, "--out", folder) == 2
    assert "cannot write the results file" in capsys.readouterr().err
    out = tmp_path / "results.jsonl"
    with ResultsFile(out):  # a second writer
        assert batch(tiny_checkpoint, image, "--out", out) == 2
    assert "another qvl batch is writing" in capsys.readouterr().err
