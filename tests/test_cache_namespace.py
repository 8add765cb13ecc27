"""Cache namespaces: requests of different cache salts (the `cache_salt` field, or different
API keys) share no cached work, so neither cache flags nor reused token counts tell one
client what another asked; the same salt shares as before; --hide-cache-stats blanks the
flags. Chat completions report the prompt's cached tokens as Responses does."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from qvl.engine import Request
from qvl.kv_cache import BLOCK
from qvl.sampling import SamplingParams
from qvl.server.app import create_app
from qvl.server.settings import ServerSettings
from tests.test_cache import ask, fresh, picture
from tests.test_server_api import wait_ready

GREEDY = SamplingParams(temperature=0, max_new_tokens=2)
SYSTEM = "You are the assistant of Example Corp. Internal codename: bluebird. " * 4  # several KV blocks
URL = "/v1/chat/completions"


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_other_salts_share_no_answer_prefix_or_image(tiny_engine):
    engine = fresh(tiny_engine)
    image = picture(7)
    first = engine.generate(ask(image, "What is it?", params=GREEDY, cache_salt="alice"))
    assert first.timings.cached == {"prefix": False, "vision": False}

    other = engine.generate(ask(image, "What is it?", params=GREEDY, cache_salt="bob"))  # an exact repeat
    assert other.timings.cached == {"prefix": False, "vision": False} and other.timings.reused_tokens == 0
    assert other.token_ids == first.token_ids  # the same answer, computed again
    unsalted = engine.generate(ask(image, "What is it?", params=GREEDY))
    assert unsalted.timings.cached == {"prefix": False, "vision": False}

    again = engine.generate(ask(image, "What is it?", params=GREEDY, cache_salt="alice"))
    assert again.timings.cached == {"answer": True} and again.token_ids == first.token_ids
    follow_up = engine.generate(ask(image, "And its colour?", params=GREEDY, cache_salt="bob"))
    assert follow_up.timings.cached["prefix"] and follow_up.timings.reused_tokens >= BLOCK


def test_other_salts_share_no_system_prompt(tiny_engine):
    engine = fresh(tiny_engine)
    engine.generate(Request(chat("Hello?"), GREEDY, cache_salt="alice"))
    probe = engine.generate(Request(chat("Hi?"), GREEDY, cache_salt="mallory"))
    assert probe.timings.reused_tokens == 0 and not probe.timings.cached["prefix"]
    same = engine.generate(Request(chat("Hi?"), GREEDY, cache_salt="alice"))
    assert same.timings.reused_tokens >= 2 * BLOCK


@pytest.fixture
def serve(tiny_engine):
    """A TestClient over a fresh-cached engine with these settings."""
    clients = []

    def start(**settings) -> TestClient:
        app = create_app(ServerSettings(**settings), lambda: fresh(tiny_engine))
        client = TestClient(app).__enter__()
        clients.append(client)
        wait_ready(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def qvl_stats(response) -> tuple[dict, int]:
    assert response.status_code == 200, response.text
    timings = response.json()["qvl"]["timings"]
    return timings["cached"], timings["reused_tokens"]


def test_each_api_key_has_caches_of_its_own(serve):
    client = serve(api_keys=("alice-key", "bob-key"))
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("alice-key", "bob-key"))
    body = {"messages": chat("What is the codename?"), "max_tokens": 2, "temperature": 0}
    assert qvl_stats(client.post(URL, json=body, headers=alice))[0].get("answer") is None
    cached, reused = qvl_stats(client.post(URL, json=body, headers=bob))  # bob repeats alice's request
    assert cached == {"prefix": False} and reused == 0
    assert qvl_stats(client.post(URL, json=body, headers=alice))[0] == {"answer": True}
    other = {**body, "messages": chat("Anything else?")}
    assert qvl_stats(client.post(URL, json=other, headers=bob))[1] >= 2 * BLOCK  # bob's own prefix

    memo = "Board memo, do not share: the merger closes in May. " * 4  # a prompt only alice has sent
    responses = {"input": "Summarise.", "instructions": memo, "max_output_tokens": 2, "temperature": 0}
    client.post("/v1/responses", json=responses, headers=alice)
    usage = client.post("/v1/responses", json={**responses, "input": "Hi"}, headers=bob).json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == 0


def test_cache_salt_field_separates_clients_of_one_key(serve):
    client = serve()
    body = {"messages": chat("What is the codename?"), "max_tokens": 2, "temperature": 0, "cache_salt": "tenant-1"}
    client.post(URL, json=body)
    cached, reused = qvl_stats(client.post(URL, json={**body, "cache_salt": "tenant-2"}))
    assert cached == {"prefix": False} and reused == 0
    assert qvl_stats(client.post(URL, json={k: v for k, v in body.items() if k != "cache_salt"}))[1] == 0
    assert qvl_stats(client.post(URL, json=body))[0] == {"answer": True}

    ollama = {"messages": chat("Hi"), "stream": False, "options": {"temperature": 0, "num_predict": 2}}
    client.post("/api/chat", json={**ollama, "cache_salt": "tenant-1"})
    assert client.post("/api/chat", json={**ollama, "cache_salt": "tenant-2"}).status_code == 200
    refused = client.post(URL, json={**body, "cache_salt": ""})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def streamed_usage(client: TestClient, body: dict) -> dict:
    with client.stream("POST", URL, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def test_chat_completions_report_cached_prompt_tokens_as_responses_do(serve):
    client = serve()
    body = {"messages": chat("What is the codename?"), "max_tokens": 2, "temperature": 0}
    first = client.post(URL, json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    follow_up = client.post(URL, json={**body, "messages": chat("Who asks?")}).json()
    cached = follow_up["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == follow_up["qvl"]["timings"]["reused_tokens"] >= 2 * BLOCK
    assert cached < follow_up["usage"]["prompt_tokens"]
    assert streamed_usage(client, {**body, "messages": chat("Where?")})["prompt_tokens_details"] == {"cached_tokens": cached}

    responses = {"input": "When?", "instructions": SYSTEM, "max_output_tokens": 2, "temperature": 0}
    as_responses = client.post("/v1/responses", json=responses).json()["usage"]["input_tokens_details"]
    assert as_responses == {"cached_tokens": cached}  # the same system prompt, reused as far


def test_hide_cache_stats_blanks_the_flags(serve):
    client = serve(hide_cache_stats=True)
    body = {"messages": chat("What is the codename?"), "max_tokens": 2, "temperature": 0}
    client.post(URL, json=body)
    assert qvl_stats(client.post(URL, json=body)) == ({}, 0)  # an answer-cache hit, not shown
    assert qvl_stats(client.post(URL, json={**body, "messages": chat("Else?")})) == ({}, 0)  # a prefix hit
    with client.stream("POST", URL, json={**body, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if '"qvl"' in line]
    assert {k: chunks[-1]["qvl"]["timings"][k] for k in ("cached", "reused_tokens")} == {"cached": {}, "reused_tokens": 0}
    assert streamed_usage(client, {**body, "messages": chat("Who?")})["prompt_tokens_details"] == {"cached_tokens": 0}

    responses = {"input": "What is the codename?", "instructions": SYSTEM, "max_output_tokens": 2, "temperature": 0}
    client.post("/v1/responses", json=responses)
    usage = client.post("/v1/responses", json={**responses, "input": "Hi"}).json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == 0


def test_serve_flags(monkeypatch):
    from qvl.cli import build_parser
    from qvl.server.cli import settings

    parser, _ = build_parser()
    monkeypatch.setenv("QVL_API_KEY", "one, two")
    config = settings(parser.parse_args(["serve", "--hide-cache-stats"]))
    assert config.api_keys == ("one", "two") and config.hide_cache_stats
    config = settings(parser.parse_args(["serve", "--api-key", "a", "--api-key", "b"]))
    assert config.api_keys == ("a", "b") and not config.hide_cache_stats
