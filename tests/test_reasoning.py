"""Thinking variants: the reasoning split from the answer (engine events, the chat API streamed
and not, the command line), the reasoning budget that forces `</think>`, and constraints that
hold the answer, not the reasoning. A tiny checkpoint with the Thinking chat template."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from qvl.engine import Engine, EngineOptions, Request
from qvl.grammar import Constraint
from qvl.stream import Delta, TextStream, Timings, Usage
from tests.test_server_api import make_app

HELLO = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory):
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("thinking"), "tiny", seed=0, thinking=True)


@pytest.fixture(scope="module")
def engine(thinking_checkpoint):
    return Engine.load(EngineOptions(model=str(thinking_checkpoint), weights="fp32", threads=2,
                                     answer_cache_entries=0, reasoning_budget=4))  # requests may set their own


def test_text_stream_splits_reasoning_from_the_answer(tiny_tokenizer):
    end = tiny_tokenizer.token_id("</think>")
    ids = tiny_tokenizer.encode("\nThe sky scatters blue light.\n") + [end] + tiny_tokenizer.encode("\n\nRayleigh.")
    stream = TextStream(tiny_tokenizer, ("zzz",), (151645,), Usage(), Timings(), time.perf_counter(), think_end=end)
    events = [e for t in ids if (e := stream.push(t)) is not None]
    tail, done = stream.close()
    events += [tail] if tail else []
    assert "".join(e.reasoning for e in events) == done.reasoning == "The sky scatters blue light."
    assert "".join(e.text for e in events) == done.text == "Rayleigh."
    assert done.usage.reasoning_tokens == len(ids) - len(tiny_tokenizer.encode("\n\nRayleigh."))


def test_budget_forces_the_end_of_reasoning(engine):
    parsed = engine.parse(Request(HELLO, engine.sampling_defaults(temperature=0, reasoning_budget=5,
                                                                  max_new_tokens=12, ignore_eos=True)))
    assert parsed.reasoning  # the template opened <think>
    events = list(engine.stream(parsed))
    done = events[-1]
    assert done.token_ids[5] == engine.think_end and done.usage.reasoning_tokens == 6
    assert done.reasoning == engine.tokenizer.decode(done.token_ids[:5]).strip("\n")
    assert done.text and "".join(e.text for e in events if isinstance(e, Delta)) == done.text
    zero = engine.generate(Request(HELLO, engine.sampling_defaults(temperature=0, reasoning_budget=0,
                                                                   max_new_tokens=4, ignore_eos=True)))
    assert zero.token_ids[0] == engine.think_end and zero.reasoning == ""


def test_a_schema_holds_the_answer_after_the_reasoning(engine):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}
    done = engine.generate(Request(HELLO, engine.sampling_defaults(
        temperature=1.0, seed=1, reasoning_budget=8, max_new_tokens=60, constraint=Constraint.json(schema))))
    assert done.finish_reason == "stop" and done.usage.reasoning_tokens == 9
    assert set(json.loads(done.text)) == {"ok", "n"}


def test_chat_api_returns_reasoning_content(engine):
    body = {"messages": HELLO, "temperature": 0, "max_tokens": 10, "ignore_eos": True, "reasoning_budget": 4}
    with TestClient(make_app(engine)) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        whole = client.post("/v1/chat/completions", json=body).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"]
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
        lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert all(not ("reasoning_content" in d and d.get("content")) for d in deltas)  # never mixed in one delta


def test_instruct_answers_carry_no_reasoning(tiny_engine):
    done = tiny_engine.generate(Request(HELLO, tiny_engine.sampling_defaults(temperature=0, max_new_tokens=3)))
    assert done.reasoning is None and "reasoning" not in done.to_dict()


def test_ask_shows_reasoning_apart(thinking_checkpoint, capsys):
    from qvl.cli import main

    args = ["ask", "-m", str(thinking_checkpoint), "--weights", "fp32", "--temperature", "0", "--reasoning-budget",
            "3", "--max-new-tokens", "8", "--ignore-eos", "Hi"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip() and err.strip()  # the answer on stdout, the reasoning on stderr
    assert main([*args, "--hide-reasoning"]) == 0
    out2, err2 = capsys.readouterr()
    assert out2 == out and err.strip() not in err2
    assert main([*args, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["reasoning"] and row["usage"]["reasoning_tokens"] == 4


def test_responses_and_ollama_carry_the_reasoning(engine):
    with TestClient(make_app(engine)) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"input": "Why?", "temperature": 0, "max_output_tokens": 8, "reasoning_budget": 3}
        r = client.post("/v1/responses", json=body).json()
        assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
        assert r["output"][0]["content"][0]["text"] and r["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
        events = [json.loads(line[6:]) for line in client.post("/v1/responses", json={**body, "stream": True}).text
                  .splitlines() if line.startswith("data: ")]
        thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert thought == r["output"][0]["content"][0]["text"]
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["reasoning", "message"]
        chat = {"messages": HELLO, "stream": False, "options": {"temperature": 0, "num_predict": 8}}
        shown = client.post("/api/chat", json=chat).json()["message"]
        assert shown["thinking"] and shown["content"]
        hidden = client.post("/api/chat", json={**chat, "think": False}).json()["message"]
        assert "thinking" not in hidden and hidden["content"] == shown["content"]
