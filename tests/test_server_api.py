"""The HTTP API in-process (fastapi TestClient over the tiny engine): the error corpus,
auth, readiness, time limits, metrics and the web page route."""

from __future__ import annotations

import base64
import json
import re
import threading
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.test_server_support import data_uri, image_message, png_bytes, png_header_only

from qvl.engine import Request
from qvl.server.app import create_app
from qvl.server.settings import MB, ImagePolicy, ServerSettings
from qvl.tasks import TASKS

URL = "/v1/chat/completions"
JSON_BODY = {"Content-Type": "application/json"}
HELLO = [{"role": "user", "content": "hello"}]


def make_app(engine, **settings):
    policy = ImagePolicy(max_bytes=MB, max_pixels=1_000_000)
    return create_app(ServerSettings(**{"max_body_bytes": 2 * MB, "images": policy, **settings}), lambda: engine)


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "engine never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(make_app(tiny_engine)) as c:
        wait_ready(c)
        yield c


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def with_image(url: str, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": "what is this?"}]}]}


def corrupt_png() -> bytes:
    data = bytearray(png_bytes(64, 64))
    data[60:200] = bytes(140)  # the header survives, the pixel data does not
    return bytes(data)


IMAGE_URL = "messages[0].content[0].image_url.url"
BAD_REQUESTS = [  # (name, body, status, param, code)
    ("malformed json", b'{"messages": [', 400, None, "invalid_json"),
    ("not utf-8", b"\xff\xfe\x00", 400, None, "invalid_json"),
    ("not an object", b"[1, 2]", 400, None, None),
    ("no messages", {"model": "x"}, 400, "messages", "missing"),
    ("empty messages", {"messages": []}, 400, "messages", None),
    ("temperature is a string", {"messages": HELLO, "temperature": "hot"}, 400, "temperature", None),
    ("temperature out of range", {"messages": HELLO, "temperature": 5}, 400, "temperature", None),
    ("temperature NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature", None),
    ("max_tokens float", {"messages": HELLO, "max_tokens": 1.5}, 400, "max_tokens", None),
    ("max_tokens zero", {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens as text", {"messages": HELLO, "max_tokens": "10"}, 400, "max_tokens", None),
    ("top_p zero", {"messages": HELLO, "top_p": 0}, 400, "top_p", None),
    ("stream not bool", {"messages": HELLO, "stream": "yes"}, 400, "stream", None),
    ("five stops", {"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("n over --max-batch", {"messages": HELLO, "n": 9}, 400, "n", None),
    ("n zero", {"messages": HELLO, "n": 0}, 400, "n", None),
    ("tool without function", {"messages": HELLO, "tools": [{"type": "function"}]}, 400, "tools[0].function", None),
    ("tool name with spaces", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name", None),
    ("tool parameters not an object schema", {"messages": HELLO, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400,
     "tools[0].function.parameters", None),
    ("tool_choice names no tool", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice", None),
    ("tool message answering no call", {"messages": [*HELLO, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
     400, "messages[1].tool_call_id", "unknown_tool_call"),
    ("call arguments not JSON", {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments", None),
    ("schema with a misspelt type", {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}, 400, "response_format",
     "invalid_grammar"),
    ("json_schema format without schema", {"messages": HELLO, "response_format": {"type": "json_schema"}}, 400,
     "response_format", None),
    ("regex that does not parse", {"messages": HELLO, "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs", "invalid_grammar"),
    ("two structured outputs", {"messages": HELLO, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs", None),
    ("forced call and a format", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "tool_choice", None),
    ("top_logprobs without logprobs", {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("top_logprobs over 20", {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("logit_bias key not a token id", {"messages": HELLO, "logit_bias": {"hello": 5}}, 400, "logit_bias", None),
    ("logit_bias token outside the vocabulary", {"messages": HELLO, "logit_bias": {"99999999": 5}}, 400,
     "logit_bias", None),
    ("logit_bias over 100", {"messages": HELLO, "logit_bias": {"5": 101}}, 400, "logit_bias.5", None),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("unknown part", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages[0].content[0].type", None),
    ("image part without url", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", None),
    ("late system message", {"messages": HELLO + [{"role": "system", "content": "x"}]}, 400,
     "messages[1].role", None),
    ("image from the assistant", with_image(data_uri(png_bytes()), role="assistant"), 400,
     "messages[0].content[0]", None),
    ("bad base64", with_image("data:image/png;base64,!!!notbase64!!!"), 400, IMAGE_URL, "invalid_image"),
    ("data uri not base64", with_image("data:image/png,rawbytes"), 400, IMAGE_URL, "invalid_image"),
    ("bytes that are not an image", with_image(data_uri(b"hello, I am text")), 400, IMAGE_URL, "invalid_image"),
    ("unsupported format (PPM)", with_image(data_uri(png_bytes(fmt="PPM"))), 400, IMAGE_URL, "invalid_image"),
    ("svg", with_image(data_uri(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")), 400,
     IMAGE_URL, "invalid_image"),
    ("over the pixel cap", with_image(data_uri(png_header_only(2000, 1000))), 400, IMAGE_URL, "invalid_image"),
    ("decompression bomb", with_image(data_uri(png_header_only(100_000, 100_000))), 400, IMAGE_URL,
     "invalid_image"),
    ("corrupt pixel data", with_image(data_uri(corrupt_png())), 400, IMAGE_URL, "invalid_image"),  # found decoding
    ("image over the byte cap", with_image(data_uri(bytes(MB + 10))), 400, IMAGE_URL, "invalid_image"),
    ("http url while fetching is off", with_image("http://example.com/cat.png"), 400, IMAGE_URL, "invalid_image"),
    ("local path while off", with_image("/etc/passwd"), 400, IMAGE_URL, "invalid_image"),
    ("too many images", {"messages": [image_message("x", *[png_bytes(8, 8)] * 9)]}, 400, "messages",
     "too_many_images"),
    ("prompt cannot fit the context", {"messages": HELLO, "max_tokens": 10**7}, 400, "messages",
     "context_length_exceeded"),
    ("bad image with stream=true", {**with_image(data_uri(b"nope")), "stream": True}, 400, IMAGE_URL,
     "invalid_image"),
]


@pytest.mark.parametrize("name,body,status,param,code", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_status_and_error_shape(client, name, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(URL, content=content, headers=JSON_BODY)
    assert_error(response, status, param, code)


def test_oversized_body_is_413(client):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (3 * MB)}]})
    assert_error(client.post(URL, content=big, headers=JSON_BODY), 413, code="body_too_large")


def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get(URL), 405)


def test_good_request_succeeds_after_the_bad_ones(client):
    for _, body, *_ in BAD_REQUESTS:  # the whole corpus again, then a good request
        client.post(URL, content=body if isinstance(body, bytes) else json.dumps(body), headers=JSON_BODY)
    response = client.post(URL, json={"messages": [image_message("what colour?", png_bytes())], "max_tokens": 4})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    assert body["qvl"]["image_tokens"] > 0


def test_max_completion_tokens_wins_and_developer_role(client):
    messages = [{"role": "developer", "content": "be brief"}, *HELLO]
    body = client.post(URL, json={"messages": messages, "max_tokens": 9, "max_completion_tokens": 3,
                                  "temperature": 0, "response_format": {"type": "text"}}).json()
    assert body["usage"]["completion_tokens"] == 3


def test_max_pixels_lowers_the_image_budget(client):
    request = {"messages": [image_message("x", png_bytes(256, 256))], "max_tokens": 1}
    full = client.post(URL, json=request).json()["qvl"]["image_tokens"]
    low = client.post(URL, json={**request, "max_pixels": 64 * 64}).json()["qvl"]["image_tokens"]
    assert low == 4 < full


def test_max_pixels_raises_the_budget_up_to_the_cap(client):
    request = {"messages": [image_message("x", png_bytes(960, 960))], "max_tokens": 1}
    default = client.post(URL, json=request).json()["qvl"]["image_tokens"]
    raised = client.post(URL, json={**request, "max_pixels": 960 * 960}).json()["qvl"]["image_tokens"]
    assert default <= 256 < raised == 900  # 30 x 30 tokens of 32 x 32 pixels
    assert_error(client.post(URL, json={**request, "max_pixels": 5000 * 1024}), 400, param="max_pixels")


def test_health_is_503_while_loading_then_200(tiny_engine):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return tiny_engine

    with TestClient(create_app(ServerSettings(), slow_load)) as c:
        assert c.get("/health").json() == {"status": "loading"}
        assert c.get("/health").status_code == 503
        assert_error(c.post(URL, json={"messages": HELLO}), 503, code="model_not_ready")
        release.set()
        wait_ready(c)
        assert c.post(URL, json={"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_failed_load_is_reported(tiny_engine):
    def broken_load():
        raise RuntimeError("no such model")

    with TestClient(create_app(ServerSettings(), broken_load)) as c:
        deadline = time.monotonic() + 10
        while c.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.get("/health").json()["status"] == "failed"
        assert "no such model" in assert_error(c.post(URL, json={"messages": HELLO}), 503)["message"]


def test_api_key_guards_api_routes_only(tiny_engine):
    with TestClient(make_app(tiny_engine, api_keys=("s3cret",))) as c:
        wait_ready(c)
        assert_error(c.post(URL, json={"messages": HELLO}), 401, code="invalid_api_key")
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/metrics"), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.post(URL, json={"messages": HELLO, "max_tokens": 1}, headers=good).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200


def test_time_limit_ends_long_requests_and_frees_the_worker(tiny_engine):
    with TestClient(make_app(tiny_engine, time_limit_s=0.5)) as c:
        wait_ready(c)
        long = {"messages": HELLO, "max_tokens": 5000}
        started = time.monotonic()
        assert_error(c.post(URL, json=long), 504, code="timeout")
        with c.stream("POST", URL, json={**long, "stream": True}) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "timeout" and events[-1] == "data: [DONE]"
        assert time.monotonic() - started < 10
        assert c.post(URL, json={"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_answer_cache_hit_skips_the_queue(tiny_engine, monkeypatch):
    done = tiny_engine.generate(Request(HELLO, tiny_engine.sampling_defaults(max_new_tokens=3)))
    monkeypatch.setattr(tiny_engine, "cached_answer", lambda parsed: done, raising=False)
    with TestClient(make_app(tiny_engine, queue_size=0)) as c:  # a queue of 0: only the cache can answer
        wait_ready(c)
        body = c.post(URL, json={"messages": HELLO}).json()
        assert body["choices"][0]["message"]["content"] == done.text
        with c.stream("POST", URL, json={"messages": HELLO, "stream": True}) as response:
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                           for line in response.iter_lines() if line.startswith("data: {"))
        assert text == done.text
        assert "qvl_answer_cache_hits_total 2" in c.get("/metrics").text


def test_metrics_in_prometheus_format(client):
    client.post(URL, json={"messages": HELLO, "max_tokens": 2})
    client.post(URL, content=b"{", headers=JSON_BODY)
    text = client.get("/metrics").text
    assert 'qvl_requests_total{path="/v1/chat/completions",status="200"}' in text
    assert 'qvl_requests_total{path="/v1/chat/completions",status="400"}' in text
    for name in ("qvl_queue_depth 0", "qvl_ready 1", "qvl_time_to_first_token_seconds_count", "qvl_queue_wait_seconds_sum",
                 "qvl_decode_tokens_per_second_bucket", "qvl_image_tokens_total", "qvl_completion_tokens_total",
                 "qvl_running_requests 0", "qvl_max_batch 8", "qvl_last_step_rows", "qvl_kv_cache_filled_bytes 0",
                 "qvl_scheduler_steps", "qvl_threads_kernels", "qvl_threads_prompt", "qvl_threads_torch", "qvl_threads_pinned",
                 "qvl_cpu_cores_busy_elsewhere",
                 "qvl_kernel_items_taken_over"):
        assert name in text
    assert int(re.search(r"^qvl_scheduler_tokens (\d+)", text, re.M).group(1)) >= 2
    assert int(re.search(r"^qvl_kernel_items (\d+)", text, re.M).group(1)) > 0  # the native kernels' work, counted
    for cache in ("vision", "prefix", "answer"):  # the engine's caches, per cache
        for name in ("qvl_cache_hits_total", "qvl_cache_misses_total", "qvl_cache_evictions_total", "qvl_cache_bytes"):
            assert f'{name}{{cache="{cache}"}}' in text


def test_web_page_carries_the_task_prompts(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for task in TASKS.values():
        assert json.dumps(task.prompt, ensure_ascii=False)[1:-1] in page.text
    assert "{{QVL_TASKS}}" not in page.text
    assert client.get("/static/app.js").status_code == 200
    assert "://" not in page.text  # nothing is fetched from elsewhere: works offline


def test_models_lists_the_loaded_model(client, tiny_engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == tiny_engine.model_name


def test_base64_with_line_breaks_is_accepted(client):
    encoded = base64.encodebytes(png_bytes()).decode()  # wrapped at 76 columns
    request = with_image(f"data:image/png;base64,{encoded}")
    assert client.post(URL, json={**request, "max_tokens": 1}).status_code == 200


def test_serve_arguments():
    from qvl.cli import build_parser
    from qvl.server.cli import is_loopback, settings

    parser, commands = build_parser()
    args = parser.parse_args(["serve", "--queue-size", "3", "--image-url-hosts", "a.com, *.B.org", "--max-body-mb", "5"])
    config = settings(args)
    assert commands["serve"] and config.queue_size == 3 and config.max_body_bytes == 5 * MB
    assert config.images.url_hosts == ("a.com", "*.b.org") and config.images.max_bytes == 5 * MB
    assert config.api_keys == () and args.host == "127.0.0.1"
    with pytest.raises(ValueError, match="queue size"):
        settings(parser.parse_args(["serve", "--queue-size", "-1"]))
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.5", "example.com"]))


def test_engine_failure_is_a_500_and_the_worker_carries_on(tiny_engine, monkeypatch):
    real_prepare = tiny_engine.prepare_steps
    failures = iter([MemoryError("out of memory")])

    def flaky_prepare(*args, **kwargs):  # what the scheduler runs when it admits a request
        if (exc := next(failures, None)) is not None:
            raise exc
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(tiny_engine, "prepare_steps", flaky_prepare)
    with TestClient(make_app(tiny_engine, warm_up=False)) as c:  # the warm-up would prepare a prompt first
        wait_ready(c)
        assert_error(c.post(URL, json={"messages": HELLO, "max_tokens": 2}), 500, code="internal_error")
        assert c.post(URL, json={"messages": HELLO, "max_tokens": 2}).status_code == 200


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=12)
FIELDS = ["messages", "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "seed",
          "presence_penalty", "n", "top_k", "repetition_penalty", "max_pixels", "tools", "response_format"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", 1]),
                                 "content": JSON | st.text(max_size=20)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5), messages=st.lists(MESSAGE, max_size=3))
def test_arbitrary_json_is_answered_400_or_200_never_500(client, body, messages):
    body = {"messages": messages, **body}
    for key in ("max_tokens", "max_completion_tokens"):  # keep accidental valid requests short
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 2
    body.setdefault("max_tokens", 2)
    response = client.post(URL, content=json.dumps(body), headers=JSON_BODY)  # NaN and Infinity included
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert_error(response, 400)


def test_the_worker_warms_up_before_the_first_request(tiny_engine, monkeypatch):
    """Ready at once; the warm-up runs in the worker, and a request sent meanwhile waits for
    it and is then answered."""
    order, release = [], threading.Event()
    warm_up = tiny_engine.warm_up

    def slow_warm_up():
        release.wait(10)
        order.append("warm-up")
        return warm_up()

    monkeypatch.setattr(tiny_engine, "warm_up", slow_warm_up)
    with TestClient(make_app(tiny_engine, warm_up=True)) as c:
        wait_ready(c)
        threading.Timer(0.3, release.set).start()
        body = c.post(URL, json={"messages": HELLO, "max_tokens": 2}).json()
        order.append("answer")
        assert body["choices"][0]["message"]["content"] is not None
    assert order == ["warm-up", "answer"]


TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]),
                              "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "a b", 1]),
                                                                 "parameters": JSON})}) | JSON
RESPONSES_FIELDS = {"input": JSON | st.text(max_size=8) | st.lists(MESSAGE, max_size=2), "instructions": JSON,
                    "text": st.fixed_dictionaries({"format": JSON}) | JSON, "tools": st.lists(TOOL, max_size=2) | JSON,
                    "tool_choice": JSON | st.sampled_from(["auto", "none", "required"]), "max_output_tokens": JSON,
                    "previous_response_id": JSON, "temperature": JSON}
OLLAMA_FIELDS = {"messages": st.lists(MESSAGE, max_size=2) | JSON, "format": JSON | st.just("json"),
                 "options": st.dictionaries(st.sampled_from(["temperature", "num_predict", "stop", "seed", "x"]),
                                            JSON, max_size=3) | JSON,
                 "tools": st.lists(TOOL, max_size=2) | JSON, "think": JSON, "stream": JSON, "images": JSON,
                 "prompt": JSON | st.text(max_size=8)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_responses_and_ollama_answer_any_json_with_200_or_400(client, data):
    """Whatever JSON arrives at the other APIs: an answer or a 400 in that API's shape, never a 500."""
    route = data.draw(st.sampled_from(["/v1/responses", "/api/chat", "/api/generate"]))
    fields = RESPONSES_FIELDS if route == "/v1/responses" else OLLAMA_FIELDS
    body = data.draw(st.fixed_dictionaries({}, optional=fields))
    if route == "/v1/responses":
        body["max_output_tokens"] = 2 if not isinstance(body.get("max_output_tokens"), int) else body["max_output_tokens"]
        body["max_output_tokens"] = min(body["max_output_tokens"], 2) if body["max_output_tokens"] > 0 else 2
    else:
        body["stream"] = False
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        body["options"] = {**options, "num_predict": 2}
    response = client.post(route, content=json.dumps(body), headers=JSON_BODY)
    assert response.status_code in (200, 400), (route, body, response.text)
    if response.status_code == 400:
        error = response.json()["error"]
        assert isinstance(error, str if route.startswith("/api/") else dict) and error
