"""The options the front doors share: what a batch job sends its workers, and batch and serve
standing on qvl.options rather than on the `qvl` command line."""

from __future__ import annotations

import pickle
import subprocess
import sys

from PIL import Image

from qvl.batch.cli import build_job
from qvl.cli import build_parser


def batch_spec(tmp_path, *flags: str):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    args = build_parser()[0].parse_args(["batch", str(tmp_path), "--out", str(tmp_path / "out.jsonl"), *flags])
    job, _ = build_job(args)
    return pickle.loads(pickle.dumps(job.spec))  # as a Ray actor receives it


def test_a_workers_sampling_comes_from_the_flags(tmp_path, tiny_engine):
    spec = batch_spec(tmp_path, "--task", "detect", "--prompt", "cats", "--regex", "[a-z]+", "--stop", "END",
                      "--max-new-tokens", "7", "--top-k", "3")
    params = spec.sampling.params(tiny_engine)
    assert params.temperature == 0.0  # a greedy task, no --temperature
    assert (params.max_new_tokens, params.top_k, params.stop) == (7, 3, ("END",))
    assert (params.constraint.kind, params.constraint.source) == ("regex", "[a-z]+")
    assert spec.sampling.grounding and "cats" in spec.prompt
    sampled = batch_spec(tmp_path, "--task", "ocr", "--temperature", "0.7").sampling.params(tiny_engine)
    assert sampled.temperature == 0.7 and sampled.constraint is None


def test_batch_and_serve_do_not_import_the_command_line():
    code = "import sys, qvl.batch.cli, qvl.batch.process, qvl.server.cli; print('qvl.cli' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
