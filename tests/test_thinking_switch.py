"""The thinking switch of a hybrid chat template (Qwen3.5's `enable_thinking`) through every
front door: the engine, chat completions' chat_template_kwargs, the Responses API's
reasoning.effort, Ollama's think, and `--think/--no-think` on the command line. A tiny
Qwen3-VL checkpoint carrying the Qwen3.5 template (the same token strings)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from qvl.engine import Engine, EngineOptions, Request
from qvl.processing.prompt import tokenize_chat
from tests.test_server_api import make_app, wait_ready

TEMPLATE = Path(__file__).resolve().parents[1] / "src" / "qvl" / "data" / "qwen3_5_chat_template.jinja"
HELLO = [{"role": "user", "content": "Why is the sky blue?"}]
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def hybrid_checkpoint(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid") / "ckpt"
    shutil.copytree(tiny_checkpoint, path)
    shutil.copyfile(TEMPLATE, path / "chat_template.jinja")
    return path


@pytest.fixture(scope="module")
def engine(hybrid_checkpoint):
    return Engine.load(EngineOptions(model=str(hybrid_checkpoint), weights="fp32", threads=2,
                                     answer_cache_entries=0, reasoning_budget=3))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(make_app(engine)) as c:
        wait_ready(c)
        yield c


def generate(engine, **switch):
    params = engine.sampling_defaults(temperature=0, max_new_tokens=8, ignore_eos=True)
    return engine.generate(Request(HELLO, params, template_kwargs=switch))


def test_engine_follows_the_switch(engine, tiny_engine):
    assert engine.thinking_switch and engine.thinks() and engine.thinks(True) and not engine.thinks(False)
    assert not tiny_engine.thinking_switch and not tiny_engine.thinks(True)  # Qwen3-VL Instruct: no switch
    off = engine.parse(Request(HELLO, template_kwargs={"enable_thinking": False}))
    prompt = engine.tokenizer.decode(off.ids.tolist(), skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n" + EMPTY_THINK) and not off.reasoning
    assert engine.parse(Request(HELLO)).reasoning and engine.parse(
        Request(HELLO, template_kwargs={"enable_thinking": True})).reasoning
    thought = generate(engine)
    assert thought.reasoning is not None and thought.usage.reasoning_tokens == 4  # the budget, then </think>
    plain = generate(engine, enable_thinking=False)
    assert plain.reasoning is None and plain.usage.reasoning_tokens == 0 and plain.text


def test_chat_template_kwargs(client):
    body = {"messages": HELLO, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    on = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert on["choices"][0]["message"]["reasoning_content"] is not None
    off = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    message = off.json()["choices"][0]["message"]
    assert off.status_code == 200 and message.get("reasoning_content") is None and message["content"]
    assert "completion_tokens_details" not in off.json()["usage"]
    lines = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}}).text
    assert "reasoning_content" not in lines


@pytest.mark.parametrize("kwargs, param", [
    ([True], "chat_template_kwargs"),
    ({"enable_thinking": {"deep": True}}, "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": [1]}, "chat_template_kwargs.enable_thinking"),
    ({"messages": "x"}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"not a name": 1}, "chat_template_kwargs"),
    ({f"k{i}": i for i in range(33)}, "chat_template_kwargs"),
])
def test_chat_template_kwargs_refused(client, kwargs, param):
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}).status_code == 200


def test_template_kwargs_cannot_write_special_tokens(engine):
    template = engine.template + "{{ note }}"
    ids = tokenize_chat(engine.tokenizer, template, HELLO, [], template_kwargs={"note": "<|im_end|>"}).ids
    assert ids[-len(engine.tokenizer.encode("<|im_end|>", special_tokens=False)):] == \
        engine.tokenizer.encode("<|im_end|>", special_tokens=False)


@pytest.mark.parametrize("effort, thinks", [("none", False), ("minimal", False), ("low", True), ("high", True),
                                            (None, True)])
def test_responses_reasoning_effort(client, effort, thinks):
    body = {"input": "Why?", "temperature": 0, "max_output_tokens": 8}
    r = client.post("/v1/responses", json={**body, "reasoning": {"effort": effort, "summary": "auto"}}).json()
    assert [item["type"] for item in r["output"]] == (["reasoning", "message"] if thinks else ["message"])


def test_responses_refuses_an_unknown_effort(client):
    r = client.post("/v1/responses", json={"input": "Why?", "reasoning": {"effort": "max"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


def test_ollama_think_sets_the_switch(client, tiny_engine):
    chat = {"messages": HELLO, "stream": False, "options": {"temperature": 0, "num_predict": 8}}
    on = client.post("/api/chat", json={**chat, "think": True}).json()
    assert on["message"]["thinking"]
    off = client.post("/api/chat", json={**chat, "think": False}).json()
    assert "thinking" not in off["message"] and off["message"]["content"]
    # not reasoning hidden, but none asked for: the prompt closed an empty <think> block
    assert off["prompt_eval_count"] == on["prompt_eval_count"] + 2
    generated = client.post("/api/generate", json={"prompt": "Hi", "stream": False, "think": False,
                                                   "options": {"num_predict": 4}}).json()
    assert "thinking" not in generated and generated["response"]
    assert "thinking" in client.post("/api/show", json={"model": "qvl"}).json()["capabilities"]
    with TestClient(make_app(tiny_engine)) as plain:
        wait_ready(plain)
        assert plain.post("/api/chat", json={**chat, "think": True}).status_code == 400
        assert "thinking" not in plain.post("/api/show", json={"model": "qvl"}).json()["capabilities"]


def test_cli_think_flags(hybrid_checkpoint, tmp_path, capsys):
    from qvl.cli import main

    args = ["ask", "-m", str(hybrid_checkpoint), "--weights", "fp32", "--threads", "2", "--temperature", "0",
            "--reasoning-budget", "2", "--max-new-tokens", "6", "--ignore-eos", "--json", "Hi"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["reasoning"] is not None
    assert main([*args, "--no-think"]) == 0
    assert "reasoning" not in json.loads(capsys.readouterr().out)
    Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype("uint8")).save(tmp_path / "a.png")
    out = tmp_path / "rows.jsonl"
    assert main(["batch", str(tmp_path), "--out", str(out), "--model", str(hybrid_checkpoint), "--weights", "fp32",
                 "--threads", "2", "--prompt", "Describe.", "--max-new-tokens", "4", "--no-think"]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    assert row["text"] is not None and "reasoning" not in row
