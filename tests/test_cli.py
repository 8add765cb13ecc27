"""`qvl ask`, `qvl info` and `qvl synth` end to end, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from qvl.processing.image import smart_resize


def qvl(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qvl.cli", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=120)


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "photo.jpg"
    Image.fromarray((np.random.RandomState(0).rand(120, 200, 3) * 255).astype("uint8")).save(path)
    return path


def test_ask_text_only_streams_an_answer(tiny_checkpoint):
    r = qvl("ask", "--model", tiny_checkpoint, "--max-new-tokens", "8", "--temperature", "0", "Hello!")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.slow  # `qvl` subprocesses
def test_ask_json_with_images_and_stdin_prompt(tiny_checkpoint, photo):
    r = qvl("ask", "--model", tiny_checkpoint, "-i", photo, "-i", photo, "--json", "--max-new-tokens", "5",
            "--max-image-tokens", "80", "--seed", "3", "-", stdin="Compare the two images.")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "usage", "timings"}
    assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 5
    h, w = smart_resize(120, 200, 32, 65536, 80 * 32 * 32)  # the budget caps each image at 80 tokens
    assert out["usage"]["image_tokens"] == 2 * (h // 32) * (w // 32) <= 160
    assert set(out["timings"]) >= {"vision_ms", "prefill_ms", "ttft_ms", "decode_ms_per_token"}
    if len(out["token_ids"]) == 5:
        assert out["finish_reason"] == "length"


@pytest.mark.slow  # `qvl` subprocesses
def test_ask_task_ocr_is_greedy_and_reproducible(tiny_checkpoint, photo):
    runs = [qvl("ask", "--model", tiny_checkpoint, "-i", photo, "--task", "ocr", "--json", "--max-new-tokens", "6")
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert json.loads(runs[0].stdout)["token_ids"] == json.loads(runs[1].stdout)["token_ids"]


@pytest.mark.parametrize("case", ["missing_image", "not_an_image", "unknown_model", "no_prompt"])
def test_bad_input_is_one_line_error(tiny_checkpoint, tmp_path, case):
    args = {
        "missing_image": ["--model", tiny_checkpoint, "-i", tmp_path / "nope.png", "hi"],
        "not_an_image": ["--model", tiny_checkpoint, "-i", tiny_checkpoint / "config.json", "hi"],
        "unknown_model": ["--model", tmp_path / "no-such-model", "hi"],
        "no_prompt": ["--model", tiny_checkpoint],
    }[case]
    r = qvl("ask", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qvl ask: error:"), r.stderr


def test_info_reports_features_dtype_threads():
    r = qvl("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["dtype_auto"] in ("bfloat16", "float32")
    assert info["threads_default"] >= 1 and "avx512_bf16" in info["cpu_features"]
    # on a shared machine torch's own ops get the cores other programs leave (qvl's kernels keep all)
    assert 1 <= info["threads_torch_now"] <= info["threads_default"] and info["cores_busy_elsewhere"] >= 0
    assert isinstance(info["threads_pinned_now"], bool)
    # the tier this CPU runs (of those it could run), and the kernel plan of the default options:
    # per kind of layer, its kernel, activation codes and dtype
    assert info["kernels"].split()[0] in info["tiers_available"].split(", ")
    plan = info["plan"]
    assert {"text linears, decode", "text linears, prefill", "lm_head", "vision linears", "text attention, prefill",
            "vision attention", "decode step", "int4 linears, decode", "int4 linears, prefill"} <= plan.keys()
    assert all(p["kernel"] and p["dtype"] == info["dtype_auto"] and p["code_bits"] in (0, 7, 8, 16)
               for p in plan.values())


@pytest.mark.slow  # `qvl` subprocesses
def test_chat_reuses_earlier_turns(tiny_checkpoint, photo):
    script = "What is in the picture?\nAnd the colours?\n/reset\nHello again\n/quit\n"
    r = qvl("chat", "--model", tiny_checkpoint, "-i", photo, "--max-new-tokens", "6", "--temperature", "0",
            stdin=script)
    assert r.returncode == 0, r.stderr
    reused = [int(line.split(" prompt tokens reused")[0].rsplit(", ", 1)[1])
              for line in r.stderr.splitlines() if "prompt tokens reused" in line]
    assert len(reused) == 3
    assert reused[0] == 0  # first turn: nothing to reuse
    assert reused[1] > 64  # second turn: the image and the first exchange come from the prefix cache
    assert reused[2] < reused[1]  # after /reset the conversation starts over


@pytest.mark.slow  # `qvl` subprocesses
def test_synth_writes_a_prequantised_checkpoint_that_answers(tmp_path, photo):
    out = tmp_path / "int4"
    r = qvl("synth", out, "--preset", "tiny", "--weights", "int4", "--group-size", "32", "--vision-int8")
    assert r.returncode == 0, r.stderr
    assert "int4 weights" in r.stdout and not (out / "model.safetensors.index.json").exists()  # one small shard
    r = qvl("ask", "--model", out, "-i", photo, "--json", "--max-new-tokens", "3", "--temperature", "0", "Describe.")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["usage"]["completion_tokens"] == 3
    from qvl.quantize import QuantSpec
    from qvl.weights import checkpoint_quantization

    assert checkpoint_quantization(out) == QuantSpec("int4", 32, vision=True)
    r = qvl("synth", tmp_path / "bad", "--vision-int8")
    assert r.returncode != 0 and "--vision-int8" in r.stderr and "--weights" in r.stderr
