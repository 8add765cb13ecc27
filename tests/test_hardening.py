"""Regressions from an attack run, outside the server: the kept-weights cache key, sampling
values that underflow, and `qvl batch` outputs that must be refused."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from qvl.batch.output import ResultsFile
from qvl.cli import main
from qvl.quantize import QuantSpec
from qvl.sampling import SamplingParams, candidates, sample
from qvl.weights import quantized_cache_dir

# -- the quantised-weights cache key -------------------------------------------------------------


def test_kept_weights_key_follows_the_content_not_the_mtime(tiny_checkpoint, tmp_path):
    """Copying another checkpoint of the same size over a model and putting the old mtime
    back must not bring back the weights quantised from the old file."""
    from qvl.synth import write_checkpoint

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    weights = model / "model.safetensors"
    other = write_checkpoint(tmp_path / "other", "tiny", seed=5) / "model.safetensors"
    assert other.stat().st_size == weights.stat().st_size and other.read_bytes() != weights.read_bytes()
    spec = QuantSpec("int8")
    started = time.perf_counter()
    before = quantized_cache_dir(model, spec, torch.bfloat16)
    assert time.perf_counter() - started < 0.5  # a few small reads, not a hash of the file
    assert quantized_cache_dir(model, spec, torch.bfloat16) == before  # stable
    stat = weights.stat()
    shutil.copyfile(other, weights)  # written in place: same path, same size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert quantized_cache_dir(model, spec, torch.bfloat16) != before


# -- sampling values that underflow float32 -------------------------------------------------------


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.randn(3, 50)
    for row in logits:
        assert candidates(row, 0, top_p)[1].tolist() == [int(row.argmax())]
    params = SamplingParams(temperature=0.7, top_p=top_p)
    assert torch.equal(sample(logits, params), logits.argmax(-1))
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert torch.equal(sample(logits, params, gens), logits.argmax(-1))


# -- qvl batch: outputs that cannot be written ---------------------------------------------------


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
