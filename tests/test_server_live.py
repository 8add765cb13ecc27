"""A real `qvl serve` process (uvicorn, tiny checkpoint) driven by the official openai client
and by raw HTTP: streaming, usage, stop, the bounded queue, disconnects and SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from qvl.engine import Request
from tests.test_server_support import image_message, live_server, png_bytes

pytestmark = pytest.mark.slow  # a `qvl serve` subprocess

HELLO = [{"role": "user", "content": "hello"}]
LONG = {"max_tokens": 2000, "temperature": 0}  # greedy "hello" on the tiny model never stops by itself
# in time: only a cancel ends such a request within a test


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    # one row at a time, so that requests queue (the scheduler's batching has its own tests)
    with live_server(tiny_checkpoint, "--queue-size", "2", "--max-batch", "1", "--request-timeout", "120") as s:
        yield s


@pytest.fixture
def client(server):
    wait_idle(server.url)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_idle(url: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(url, "qvl_busy") or metric(url, "qvl_queue_depth"):
        assert time.monotonic() < deadline, "the worker did not become idle"
        time.sleep(0.05)


def prompt_tokens(engine, text: str, *images: bytes) -> int:
    """What the engine counts for one user message, built without the server's code."""
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return len(engine.parse(Request([{"role": "user", "content": content}])).ids)


def test_non_streaming_text_and_usage(client, tiny_engine):
    assert [m.id for m in client.models.list()] == [tiny_engine.model_name]
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    assert r.usage.prompt_tokens == prompt_tokens(tiny_engine, "hello")
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_streaming_with_an_image_matches_non_streaming(client, tiny_engine):
    image = png_bytes(96, 64)
    messages = [image_message("What is in this picture?", image)]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    with_image = prompt_tokens(tiny_engine, "What is in this picture?", image)
    assert whole.usage.prompt_tokens == with_image > prompt_tokens(tiny_engine, "What is in this picture?")
    assert whole.usage.completion_tokens == 8


def test_logprobs_through_the_openai_client(client, tiny_engine):
    """logprobs / top_logprobs / logit_bias in OpenAI's shape, streaming and not; the extras
    vLLM names (min_p, ignore_eos) through extra_body."""
    kw = dict(model="tiny", messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
              logit_bias={"1234": 100}, extra_body={"ignore_eos": True, "min_p": 0.05})
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 == whole.usage.completion_tokens
    expected = tiny_engine.tokenizer.token_bytes(1234)
    assert all(c.bytes == list(expected) and len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)
    streamed = [lp for chunk in client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_stop_is_honoured(client):
    text = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12,
                                          temperature=0).choices[0].message.content
    stop = text[len(text) // 2:][:2]
    expected = text[:text.find(stop)]
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                            stop=stop, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_repeatable(client):
    def sample():
        return client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=1.0,
                                              top_p=0.9, seed=7, presence_penalty=0.5,
                                              frequency_penalty=0.5).choices[0].message.content

    assert sample() == sample()


def test_errors_reach_the_client_as_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HELLO, n=3)
    assert info.value.body["param"] == "n"


def test_more_clients_than_the_queue_holds(client):
    outcomes: list[str] = []

    def call():
        try:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8)
            outcomes.append("ok")
        except openai.RateLimitError as e:
            assert int(e.response.headers["retry-after"]) >= 1
            outcomes.append("429")

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(outcomes) == 8 and "ok" in outcomes and set(outcomes) <= {"ok", "429"}


class Stream:
    """A streaming completion read line by line; leaving `lines` unfinished keeps it open
    (breaking out of httpx's iter_lines would close the connection)."""

    def __init__(self, http: httpx.Client):
        request = http.build_request("POST", "/v1/chat/completions", json={"messages": HELLO, **LONG, "stream": True})
        self.response = http.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()

    def wait_for_content(self) -> None:
        for line in self.lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return
        raise AssertionError("the stream ended without content")

    def close(self) -> None:
        self.response.close()


def test_full_queue_gets_429_and_disconnects_free_the_worker(server):
    wait_idle(server.url)
    cancelled_before = metric(server.url, 'qvl_cancelled_total{reason="disconnect"}')
    with httpx.Client(base_url=server.url, timeout=30) as http:
        running = Stream(http)
        running.wait_for_content()
        queued = [Stream(http), Stream(http)]  # the queue holds 2
        assert metric(server.url, "qvl_queue_depth") == 2
        started = time.monotonic()
        refused = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
        assert refused.status_code == 429 and time.monotonic() - started < 2
        assert refused.json()["error"]["code"] == "queue_full" and int(refused.headers["Retry-After"]) >= 1

        running.close()  # the client goes away: its generation stops, the next request starts
        queued[0].wait_for_content()
        assert metric(server.url, "qvl_queue_depth") == 1
        for response in queued:
            response.close()
        wait_idle(server.url, timeout_s=10)
        answer = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
        assert answer.status_code == 200
    assert metric(server.url, 'qvl_cancelled_total{reason="disconnect"}') - cancelled_before == 3


def test_non_streaming_disconnect_cancels_too(server):
    wait_idle(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HELLO, **LONG}, timeout=1.5)
    wait_idle(server.url, timeout_s=10)


def test_sigterm_ends_in_flight_work_cleanly(tiny_checkpoint):
    with live_server(tiny_checkpoint, "--shutdown-timeout", "1") as server:
        lines: list[str] = []

        def stream():
            with httpx.Client(base_url=server.url, timeout=30) as http:
                lines.extend(line for line in Stream(http).lines if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 20
        while not metric(server.url, "qvl_busy"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        reader.join(20)
        assert not reader.is_alive(), "the stream hung after SIGTERM"
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down" and lines[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has shut down cleanly, as process managers expect
        assert server.proc.wait(20) in (0, -signal.SIGTERM)
