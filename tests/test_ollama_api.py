"""Ollama's API, through the official `ollama` Python client unchanged and raw HTTP, against a
live `qvl serve` on the tiny random checkpoint."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import ollama
import pytest
from pydantic import BaseModel, Field

from tests.test_server_support import live_server, png_bytes

pytestmark = pytest.mark.slow  # a `qvl serve` subprocess


class Caption(BaseModel):
    subject: str = Field(max_length=16)
    color: Literal["red", "green", "blue", "other"]
    count: int = Field(ge=0, le=9)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                                          "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with live_server(tiny_checkpoint, "--request-timeout", "120") as s:
        yield s


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, timeout=120)


@pytest.mark.parametrize("seed", range(3))
def test_chat_with_an_image_and_a_schema(client, seed):
    r = client.chat(model="tiny", format=Caption.model_json_schema(),
                    messages=[{"role": "user", "content": "What is in the picture?", "images": [png_bytes(64, 48)]}],
                    options={"temperature": 1.0, "seed": seed, "num_predict": 200})
    assert r.done and r.done_reason == "stop" and r.message.role == "assistant"
    Caption.model_validate_json(r.message.content)
    assert r.prompt_eval_count > 64 and r.eval_count > 3 and r.eval_duration > 0


def test_chat_streams_ndjson(client, server):
    parts = list(client.chat(model="tiny", stream=True, messages=[{"role": "user", "content": "hello"}],
                             options={"temperature": 0, "num_predict": 6}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    text = "".join(p.message.content for p in parts)
    whole = client.chat(model="tiny", messages=[{"role": "user", "content": "hello"}],
                        options={"temperature": 0, "num_predict": 6})
    assert text == whole.message.content and whole.eval_count == 6
    # what `curl -d` sends (form content type), streamed by default
    with httpx.stream("POST", f"{server.url}/api/generate", timeout=60,
                      content='{"model": "x", "prompt": "hi", "options": {"num_predict": 3, "temperature": 0}}',
                      headers={"Content-Type": "application/x-www-form-urlencoded"}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 3 and "response" in lines[0]


def test_generate_json_and_tool_calls(client):
    r = client.generate(model="tiny", prompt="Give JSON", format="json", images=[png_bytes(32, 32)],
                        options={"temperature": 0, "num_predict": 60})
    assert r.response.startswith("{")
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                    options={"temperature": 0, "num_predict": 8})
    assert r.done  # auto: the random model may or may not call
    follow = client.chat(model="tiny", options={"temperature": 0, "num_predict": 4}, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                           "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 C", "tool_name": "get_weather"}])
    assert follow.done


def test_model_listing_and_errors(client, server, tiny_engine):
    tags = client.list()
    assert [m.model for m in tags.models] == [f"{tiny_engine.model_name}:latest"]
    shown = client.show("tiny")
    assert "vision" in shown.capabilities and "tools" in shown.capabilities
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    assert client.ps().models[0].model == f"{tiny_engine.model_name}:latest"
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model="tiny", messages=[{"role": "user", "content": "x"}], format={"type": "strnig"})
    assert bad.value.status_code == 400 and "strnig" in bad.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model="tiny", messages=[{"role": "tool", "content": "12 C"}])
    assert bad.value.status_code == 400 and "tool" in bad.value.error
    r = httpx.post(f"{server.url}/api/chat", json={"messages": [{"role": "user", "content": "x", "images": ["@@"]}]})
    assert r.status_code == 400 and set(r.json()) == {"error"}
