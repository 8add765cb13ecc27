"""`qvl serve --ray`: two replicas on a local Ray cluster behind the same API. The official
openai client streams and not, with images; follow-ups about an image reach that image's
replica; errors, limits and metrics keep their single-process shapes; a replica killed
mid-stream ends the stream with a clean error and the next request is answered elsewhere."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from qvl.server.affinity import routing_key
from qvl.server.metrics import merge_texts
from tests.test_server_support import LiveServer, data_uri, image_message, png_bytes

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'qvl[ray]'")
openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve", reason="Ray Serve is part of the ray extra: pip install 'qvl[ray]'")

from qvl.server.ray_router import owner, within_bound  # noqa: E402  (needs ray.serve)

REPLICA = "x-qvl-replica"


# --- routing keys and the owner choice (no cluster) ---

def chat_body(*messages: dict) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages)}).encode()


def test_a_follow_up_about_an_image_has_the_image_key_and_other_images_do_not():
    red, blue = png_bytes(color=(200, 0, 0)), png_bytes(color=(0, 0, 200))
    first = routing_key("/v1/chat/completions", chat_body(image_message("what is this?", red)))
    again = routing_key("/v1/chat/completions", chat_body(image_message("and its color?", red)))
    turn2 = routing_key("/v1/chat/completions", chat_body(image_message("what is this?", red),
                                                          {"role": "assistant", "content": "a square"},
                                                          {"role": "user", "content": "bigger?"}))
    other = routing_key("/v1/chat/completions", chat_body(image_message("what is this?", blue)))
    assert first == again == turn2 and first != other
    assert first.startswith("media:")  # the router holds image keys against load imbalance
    # the same image through the Responses API and Ollama's keeps its key within each API
    responses = [routing_key("/v1/responses", json.dumps({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_uri(red)}, {"type": "input_text", "text": q}]}]}).encode())
        for q in ("a", "b")]
    assert responses[0] == responses[1] and responses[0] is not None
    import base64
    ollama = [routing_key("/api/chat", json.dumps({"messages": [{"role": "user", "content": q,
                                                                  "images": [base64.b64encode(red).decode()]}]}).encode())
              for q in ("a", "b")]
    assert ollama[0] == ollama[1] and ollama[0] is not None


def test_a_conversation_keeps_its_key_and_bodies_without_content_have_none():
    hello = {"role": "user", "content": "hello"}
    one = routing_key("/v1/chat/completions", chat_body({"role": "system", "content": "be brief"}, hello))
    two = routing_key("/v1/chat/completions", chat_body({"role": "system", "content": "be brief"}, hello,
                                                        {"role": "assistant", "content": "hi"},
                                                        {"role": "user", "content": "how are you"}))
    stranger = routing_key("/v1/chat/completions", chat_body({"role": "user", "content": "bonjour"}))
    assert one == two and one != stranger and one.startswith("lead:")
    assert routing_key("/v1/chat/completions", b"{not json") is None
    assert routing_key("/v1/models", b"") is None


def test_owners_move_only_for_keys_a_leaving_replica_held():
    replicas = ["a1", "b2", "c3"]
    keys = [f"key{i}" for i in range(300)]
    before = {k: owner(k, replicas) for k in keys}
    after = {k: owner(k, ["a1", "c3"]) for k in keys}
    assert {before[k] for k in keys} == set(replicas)  # every replica owns some keys
    assert all(after[k] == before[k] for k in keys if before[k] != "b2")


def test_an_owner_holding_more_than_its_share_is_passed_over():
    assert within_bound(0, [0, 0])  # idle: the owner takes it
    assert within_bound(4, [4, 3])  # 5 of 8 on one of two replicas: within 1.25 x the mean
    assert not within_bound(5, [5, 1])  # 6 of 7: the other replica should take it
    assert not within_bound(3, [3, 0, 0, 0])  # 4 of 4 on one of four replicas


def test_metrics_of_replicas_add_up():
    one = "# TYPE qvl_requests_total counter\nqvl_requests_total{path=\"/\",status=\"200\"} 3\n" \
          "# TYPE qvl_queue_depth gauge\nqvl_queue_depth 1\n"
    two = "# TYPE qvl_requests_total counter\nqvl_requests_total{path=\"/\",status=\"200\"} 4\n" \
          "qvl_requests_total{path=\"/\",status=\"400\"} 1\n# TYPE qvl_queue_depth gauge\nqvl_queue_depth 2\n"
    merged = merge_texts([one, two])
    assert 'qvl_requests_total{path="/",status="200"} 7' in merged
    assert 'qvl_requests_total{path="/",status="400"} 1' in merged
    assert "qvl_queue_depth 3" in merged and merged.count("# TYPE qvl_queue_depth gauge") == 1
    # a series only the second replica has stays in its family (Prometheus wants families whole)
    assert merged.index('status="400"') < merged.index("# TYPE qvl_queue_depth")


def test_cluster_flags_without_ray_or_a_maximum_are_refused(tiny_checkpoint, capsys):
    from qvl.cli import main

    assert main(["serve", "--model", str(tiny_checkpoint), "--replicas", "2"]) == 1
    assert "need --ray" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_checkpoint), "--ray", "--min-replicas", "2"]) == 1
    assert "--min-replicas needs --max-replicas" in capsys.readouterr().err


def front_request(path: str, headers: dict[str, str], received: list):
    from starlette.requests import Request

    async def receive() -> dict:
        received.append(path)  # reading the body: must not happen for a refused client
        return {"type": "http.request", "body": b"x" * 1000, "more_body": False}

    scope = {"type": "http", "method": "POST" if path.startswith("/v1/") else "GET", "path": path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], "client": ("1.2.3.4", 5)}
    return Request(scope, receive)


def test_the_front_refuses_a_wrong_host_or_key_before_reading_the_body():
    import asyncio

    from qvl.server.cluster import Front
    from qvl.server.settings import ServerSettings

    front = Front(None, None, ServerSettings(api_keys=("sesame",), allowed_hosts=("localhost",)))
    received: list = []
    cases = [("/v1/chat/completions", {"host": "localhost"}, 401),
             ("/metrics", {"host": "localhost", "authorization": "Bearer wrong"}, 401),
             ("/api/chat", {"host": "localhost"}, 401),
             ("/v1/chat/completions", {"host": "evil.example", "authorization": "Bearer sesame"}, 421)]
    for path, headers, status in cases:
        answer = asyncio.run(front(front_request(path, headers, received)))
        assert answer.status_code == status, (path, answer.body)
        assert (b"x-frame-options", b"DENY") in answer.raw_headers
        shape = json.loads(answer.body)["error"]
        assert isinstance(shape, str) if path.startswith("/api/") else shape["code"]  # Ollama's shape or OpenAI's
    assert received == []


def test_a_stream_cut_by_a_lost_replica_ends_in_its_routes_own_error_format():
    from qvl.server.cluster import replica_lost, stream_failure

    error = replica_lost(RuntimeError("gone"))
    chat = stream_failure("/v1/chat/completions", error, 3).decode()
    assert chat.endswith("data: [DONE]\n\n")
    assert json.loads(chat.split("\n\n")[0].removeprefix("data: "))["error"]["code"] == "replica_unavailable"
    responses = stream_failure("/v1/responses", error, 7).decode()
    assert responses.startswith("event: error\n") and json.loads(responses.split("data: ")[1])["sequence_number"] == 7
    assert json.loads(stream_failure("/api/chat", error, 0)) == {"error": error.message}
    assert stream_failure("/static/app.js", error, 0) == b""


# --- a live cluster ---

@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    """A local Ray cluster (this process drives it, to kill a replica) and `qvl serve --ray`
    joining it with two replicas, autoscaled up to three (2 rows each, so load shows soon)."""
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR")
    address = ray.get_runtime_context().gcs_address
    server = LiveServer(tiny_checkpoint, "--ray", "--ray-address", address, "--min-replicas", "2",
                        "--max-replicas", "3", "--max-batch", "2", "--queue-size", "1", "--max-body-mb", "1",
                        "--shutdown-timeout", "3")
    try:
        server.wait_ready(timeout_s=180)
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health", timeout=5).json().get("replicas") != 2:
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.5)
        yield server
        server.proc.terminate()  # SIGTERM: the application is taken down, the command ends cleanly
        assert server.proc.wait(60) == 0, server.output()
    finally:
        server.stop()
        ray.shutdown()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_openai_client_streams_and_not_with_images(cluster):
    c = client(cluster)
    image = png_bytes(color=(10, 200, 30))
    answer = c.chat.completions.create(model="m", messages=[image_message("Describe it.", image)], max_tokens=6,
                                       temperature=0)
    assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
    assert answer.usage.prompt_tokens > 10  # the image's tokens are in the prompt
    stream = c.chat.completions.create(model="m", messages=[image_message("Describe it.", image)], max_tokens=6,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == answer.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    models = c.models.list()
    assert [m.id for m in models.data] == ["tinyck"] or len(models.data) == 1


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_follow_ups_about_an_image_reach_its_replica(cluster):
    c = client(cluster)
    seen: dict[int, set[str]] = {}
    for i in range(12):
        image = png_bytes(color=(i * 20, 255 - i * 20, 7))
        for question in ("What is it?", "What color?", "How big?"):
            raw = c.chat.completions.with_raw_response.create(model="m", messages=[image_message(question, image)],
                                                              max_tokens=2)
            seen.setdefault(i, set()).add(raw.headers[REPLICA])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    assert len(set().union(*seen.values())) == 2  # and the images are spread over both replicas


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_errors_limits_and_metrics_keep_their_shapes(cluster):
    url = cluster.url
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{oops", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    big = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (2 * 1024 * 1024),
                     headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    ollama = httpx.post(f"{url}/api/chat", json={"model": "m", "messages": "nope"})
    assert ollama.status_code == 400 and isinstance(ollama.json()["error"], str)
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "<html" in page.text.lower()

    wrong_host = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, headers={"Host": "evil.example"})
    assert wrong_host.status_code == 421 and wrong_host.json()["error"]["type"]  # refused before the body is read
    assert httpx.get(f"{url}/metrics", headers={"Host": "evil.example"}).status_code == 421
    assert httpx.get(f"{url}/health").headers["x-frame-options"] == "DENY"
    deadline = time.monotonic() + 15
    while not {"qvl_replicas 2", "qvl_ready 2"} <= set(httpx.get(f"{url}/metrics").text.splitlines()):
        assert time.monotonic() < deadline  # reports arrive every 2 s
        time.sleep(0.5)

    def count() -> float:
        text = httpx.get(f"{url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('qvl_requests_total{path="/v1/chat/completions",status="400"}'))

    # refusals the front answers itself (the body limit) are counted too
    assert 'qvl_requests_total{path="/v1/chat/completions",status="413"} 1' in httpx.get(f"{url}/metrics").text
    before = count()
    httpx.post(f"{url}/v1/chat/completions", content=b"{oops", headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while count() < before + 1:  # replicas report every 2 s
        assert time.monotonic() < deadline
        time.sleep(0.5)


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_a_client_leaving_mid_stream_cancels_its_request(cluster):
    def cancelled() -> float:
        text = httpx.get(f"{cluster.url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('qvl_cancelled_total{reason="disconnect"}'))

    before = cancelled()
    # an answer far longer than noticing a client left takes (a whole one would not count as cancelled)
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 16000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while cancelled() < before + 1:
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.5)
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting for the whole answer
        httpx.post(f"{cluster.url}/v1/chat/completions", json={**body, "stream": False}, timeout=2)
    deadline = time.monotonic() + 20
    while cancelled() < before + 2:
        assert time.monotonic() < deadline, "the replica kept generating a whole answer for a client that left"
        time.sleep(0.5)


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_a_replica_killed_mid_stream_gives_a_clean_error_then_another_answers(cluster):
    c = client(cluster)
    messages = [{"role": "user", "content": "tell me a long story"}]
    raw = c.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=4000, stream=True,
                                                      extra_body={"ignore_eos": True})
    victim = raw.headers[REPLICA]
    stream = raw.parse()
    next(iter(stream))
    ray.kill(ray.get_actor(f"SERVE_REPLICA::qvl#Replica#{victim}", namespace="serve"), no_restart=True)
    with pytest.raises(openai.APIError, match="replica"):
        for _ in stream:
            pass
    again = c.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=3)
    assert again.headers[REPLICA] != victim and again.parse().choices[0].message.content is not None


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_load_past_every_row_adds_a_replica(cluster):
    """It leaves three replicas. Six clients streaming against 2 x 2 rows keep requests
    waiting; the autoscaler (target: --max-batch per replica) adds the third replica."""
    deadline = time.monotonic() + 60  # after the kill test: back to the minimum of 2 first
    while httpx.get(f"{cluster.url}/health", timeout=5).json().get("replicas") != 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    stop = time.monotonic() + 90
    body = {"model": "m", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000, "ignore_eos": True}

    def load(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < stop:
                with contextlib.suppress(httpx.HTTPError):  # the server may stop under it at the end
                    http.post(f"{cluster.url}/v1/chat/completions", json={**body, "seed": i})

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    try:
        while httpx.get(f"{cluster.url}/health", timeout=5).json().get("replicas") != 3:
            assert time.monotonic() < stop, "no third replica after 90 s of load"
            time.sleep(1)
    finally:
        stop = time.monotonic()


@pytest.mark.slow  # a local Ray cluster and `qvl serve --ray`
def test_past_every_replica_and_queue_the_cluster_answers_429(cluster):
    """2 rows + 1 waiting per replica, 1 x the most replicas waiting at the front: at most
    3 x 3 + 3 = 12 requests are held; of 16 at once some get 429 queue_full with Retry-After,
    as one `qvl serve` answers past its queue."""
    body = {"model": "m", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    statuses: list[tuple[int, dict, str]] = []
    release = threading.Event()

    def client(i: int) -> None:
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json={**body, "seed": i}, timeout=60) as r:
            statuses.append((r.status_code, dict(r.headers), r.read().decode() if r.status_code != 200 else ""))
            release.wait(30)  # hold the stream open (a 200 keeps generating) until all have answered

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30  # the held ones answer when rows free up; a refusal comes at once
    while not any(code == 429 for code, _, _ in statuses) and time.monotonic() < deadline:
        time.sleep(0.2)
    release.set()
    busy = [(h, b) for code, h, b in statuses if code == 429]
    assert busy, sorted(code for code, _, _ in statuses)
    headers, text = busy[0]
    assert json.loads(text)["error"]["code"] == "queue_full" and int(headers["retry-after"]) >= 1
