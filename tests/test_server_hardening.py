"""Regressions from an attack run on the server: slow and silent clients, the Host/Origin
checks, JSON-only bodies, page headers, HEAD, sampling underflow over HTTP, and /health
during shutdown. Live tests run uvicorn in a thread on 127.0.0.1 with small timeouts."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi.testclient import TestClient

from qvl.server.app import create_app
from qvl.server.cli import LOOPBACK_HOSTS
from qvl.server.connections import FRESH_S
from qvl.server.serve import Server, config
from qvl.server.settings import MB, ConnectionLimits, ImagePolicy, ServerSettings

URL = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
LOCAL = "http://127.0.0.1:8000"


def make_settings(**changes) -> ServerSettings:
    base = dict(max_body_bytes=2 * MB, images=ImagePolicy(max_bytes=MB), warm_up=False,
                allowed_hosts=LOOPBACK_HOSTS + ("qvl.example", "*.lan.example"),
                allowed_origins=("qvl.example", "*.lan.example"))
    return ServerSettings(**{**base, **changes})


def wait_ready(get) -> None:
    deadline = time.monotonic() + 30
    while get("/health").status_code != 200:
        assert time.monotonic() < deadline, "engine never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(make_settings(), lambda: tiny_engine), base_url=LOCAL) as c:
        wait_ready(c.get)
        yield c


def error_code(response) -> str:
    return response.json()["error"]["code"]


# -- Host, Origin, Content-Type, headers, HEAD ----------------------------------------------------


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1:8000", True), ("localhost:8000", True), ("LOCALHOST", True), ("[::1]:8000", True),
    ("127.0.0.2:8000", True), ("qvl.example", True), ("a.lan.example:9", True), ("localhost.:8000", True),
    ("evil.example", False), ("qvl.example.evil.org", False), ("lan.example", False), ("10.0.0.5:8000", False),
    ("localhost.evil.org", False),
])
def test_only_allowed_hosts_are_answered(client, host, ok):
    """A page whose own name resolves to 127.0.0.1 (DNS rebinding) sends its name as Host."""
    for path in ("/health", "/", "/v1/models"):
        response = client.get(path, headers={"Host": host})
        assert (response.status_code != 421) is ok, (path, response.text)
    if not ok:
        assert error_code(response) == "invalid_host"


def test_requests_from_other_origins_are_refused(client):
    body = {"messages": HELLO, "max_tokens": 1}
    for origin in ("http://evil.example", "null", "http://127.0.0.1:9999", "http://localhost:8000",
                   "file://", "https://qvl.example.evil.org"):
        response = client.post(URL, json=body, headers={"Origin": origin})
        assert response.status_code == 403 and error_code(response) == "invalid_origin", origin
    for origin in (LOCAL, "https://qvl.example", "http://x.lan.example:3000"):  # own page, allowed hosts
        assert client.post(URL, json=body, headers={"Origin": origin}).status_code == 200, origin
    assert client.post(URL, json=body).status_code == 200  # no Origin: not a browser


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_api_bodies_must_be_json(client, content_type):
    """What a page may send to any site without a preflight is not accepted."""
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post(URL, content=json.dumps({"messages": HELLO, "max_tokens": 1}), headers=headers)
    assert response.status_code == 415 and error_code(response) == "unsupported_media_type"


def test_json_with_parameters_is_json(client):
    body = json.dumps({"messages": HELLO, "max_tokens": 1})
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        assert client.post(URL, content=body, headers={"Content-Type": content_type}).status_code == 200


def test_page_headers_and_head(client):
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    assert "content-security-policy" in client.get("/health").headers
    assert "content-security-policy" in client.get("/", headers={"Host": "evil.example"}).headers
    for path in ("/", "/health"):
        head = client.head(path)
        assert head.status_code == 200 and head.content == b"", path


def test_serve_flags_set_the_host_checks():
    from qvl.cli import build_parser
    from qvl.server.cli import settings

    parser, _ = build_parser()
    local = settings(parser.parse_args(["serve", "--allowed-hosts", "Qvl.Example., *.lan", "--header-timeout", "3",
                                        "--body-timeout", "7", "--keep-alive-timeout", "2", "--max-connections", "9"]))
    assert local.allowed_hosts == LOOPBACK_HOSTS + ("qvl.example", "*.lan")
    assert local.allowed_origins == ("qvl.example", "*.lan")
    assert local.connections == ConnectionLimits(max_connections=9, header_timeout_s=3, body_timeout_s=7,
                                                 keep_alive_s=2)
    assert settings(parser.parse_args(["serve", "--host", "0.0.0.0"])).allowed_hosts is None
    assert settings(parser.parse_args(["serve", "--host", "0.0.0.0", "--allowed-hosts", "a.com"])).allowed_hosts == (
        "a.com",)
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        settings(parser.parse_args(["serve", "--header-timeout", "0"]))


# -- sampling values that underflow -----------------------------------------------------------------


def test_top_p_below_float32_is_answered(client):
    body = {"messages": HELLO, "max_tokens": 3, "temperature": 1.0, "top_p": 1e-300}
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    with client.stream("POST", URL, json={**body, "stream": True}) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


# -- live: silent and slow clients ----------------------------------------------------------------


@dataclass
class Live:
    url: str
    port: int
    server: Server
    thread: threading.Thread


@contextlib.contextmanager
def live(engine, limits: ConnectionLimits, send_buffer: int | None = None, **changes):
    """qvl's uvicorn server in a thread, on a listening socket of its own: accepted sockets
    inherit its `send_buffer` (a small one fills after a few KB instead of megabytes)."""
    listener = socket.socket()
    if send_buffer:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    app = create_app(make_settings(connections=limits, **changes), lambda: engine)
    server = Server(config(app, "127.0.0.1", port, "warning"), app.state.qvl)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    wait_ready(lambda path: httpx.get(url + path, timeout=5))
    try:
        yield Live(url, port, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


@dataclass
class Client:
    """A raw TCP client; `closed_after` is when the server closed it (seconds from its start)."""

    port: int
    head: bytes = b""  # sent at once
    drip: bytes = b""  # then one byte per tick
    sock: socket.socket = field(init=False)
    started: float = field(init=False)
    received: bytes = b""
    closed_after: float | None = None

    def __post_init__(self):
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.sock.setblocking(False)
        self.started = time.monotonic()
        if self.head:
            self.sock.sendall(self.head)

    def tick(self) -> None:
        if self.closed_after is not None:
            return
        try:
            while chunk := self.sock.recv(4096):
                self.received += chunk
            self.closed_after = time.monotonic() - self.started  # EOF
            return
        except BlockingIOError:
            pass
        except OSError:
            self.closed_after = time.monotonic() - self.started
            return
        if self.drip:
            try:
                self.sock.send(self.drip[:1])
                self.drip = self.drip[1:] or self.drip  # keep going past the end
            except OSError:
                self.closed_after = time.monotonic() - self.started


def ticking(clients: list[Client], stop: threading.Event, every_s: float = 0.25) -> threading.Thread:
    def run():
        while not stop.wait(every_s):
            for c in clients:
                c.tick()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def head(port: int, content_length: int | None = None) -> bytes:
    body = f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n" if content_length else ""
    return f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{body}".encode()


def test_silent_and_dribbling_clients_do_not_lock_anyone_out(tiny_engine):
    """200 silent connections and 20 dribbling clients against the default 64 connections:
    /health and a real request are answered, the dribblers are dropped by the deadlines."""
    limits = ConnectionLimits(header_timeout_s=2.0, body_timeout_s=2.0, keep_alive_s=1.0)
    with live(tiny_engine, limits) as srv:
        url, port = srv.url, srv.port
        silent = [Client(port) for _ in range(200)]
        heads = [Client(port, head=head(port)[:20], drip=b"X-Slow: " + b"a" * 100) for _ in range(10)]
        bodies = [Client(port, head=head(port, 100) + b"\r\n{", drip=b"a") for _ in range(10)]
        stop = threading.Event()
        ticker = ticking(silent + heads + bodies, stop)
        try:
            started = time.monotonic()
            with httpx.Client(base_url=url, timeout=30) as http:
                assert http.get("/health").status_code == 200
                answer = http.post(URL, json={"messages": HELLO, "max_tokens": 2})
                assert answer.status_code == 200, answer.text
            assert time.monotonic() - started < 20  # generous: the point is that they are answered at all
            deadline = time.monotonic() + 8
            while any(c.closed_after is None for c in heads + bodies) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            stop.set()
            ticker.join(5)
            for c in silent + heads + bodies:
                c.sock.close()
        slack = 2.5  # the ticker's period and a busy 2-core machine
        for c in heads + bodies:
            assert c.closed_after is not None and c.closed_after < 2.0 + slack, c.closed_after
        assert all(c.received.startswith(b"HTTP/1.1 408") for c in bodies)  # told why, not just cut off
        assert all(c.closed_after is not None for c in silent)  # made room, or timed out


def test_a_slow_next_request_on_a_kept_connection_is_dropped(tiny_engine):
    """uvicorn stops its keep-alive timer at the next byte; the head deadline still runs."""
    limits = ConnectionLimits(header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_s=1.0)
    with live(tiny_engine, limits) as srv:
        url, port = srv.url, srv.port
        c = Client(port, head=f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(),
                   drip=b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100)
        stop = threading.Event()
        ticker = ticking([c], stop, every_s=0.2)
        deadline = time.monotonic() + 8
        while c.closed_after is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        ticker.join(5)
        c.sock.close()
        assert c.received.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in c.received
        assert c.closed_after is not None and c.closed_after < 1.0 + 2.0


def test_room_is_made_from_idle_connections_only(tiny_engine):
    """Past --max-connections the longest-idle connection goes; when every connection carries
    a request, one still sending its body gets 408 (tests/test_connections.py: which one, and
    the 503 when all are being answered)."""
    limits = ConnectionLimits(max_connections=3, header_timeout_s=30, body_timeout_s=30)
    with live(tiny_engine, limits) as srv:
        connections = srv.server.server_state.connections

        def until(condition) -> None:
            deadline = time.monotonic() + 10
            while not condition():
                assert time.monotonic() < deadline, "timed out"
                time.sleep(0.02)

        def in_request() -> int:
            return sum(c.in_request for c in list(connections))

        idle = Client(srv.port)
        until(lambda: len(connections) == 1)
        busy = [Client(srv.port, head=head(srv.port, 100) + b"\r\n{") for _ in range(2)]
        until(lambda: in_request() == 2)
        time.sleep(FRESH_S)  # a connection idle for less is given the time to send its head
        newcomer = Client(srv.port)  # the 4th: the idle one makes room
        until(lambda: (idle.tick(), idle.closed_after)[1] is not None)
        for c in [newcomer, *busy]:
            c.tick()
            assert c.closed_after is None
        newcomer.sock.sendall(head(srv.port, 100) + b"\r\n{")  # now all three carry requests
        until(lambda: in_request() == 3)
        senders = [newcomer, *busy]
        later = Client(srv.port)
        until(lambda: any((c.tick(), c.closed_after)[1] is not None for c in senders))
        assert sum(c.received.startswith(b"HTTP/1.1 408") for c in senders) == 1
        later.tick()
        assert later.closed_after is None
        for c in [idle, later, *senders]:
            c.sock.close()


# -- live: shutdown ---------------------------------------------------------------------------------


def test_health_answers_503_while_shutting_down(tiny_engine):
    """SIGTERM: the listener stays open while in-flight work drains, so /health says 503
    instead of refusing the connection; the running stream ends with shutting_down."""
    limits = ConnectionLimits()
    with live(tiny_engine, limits, shutdown_grace_s=1.5) as srv:
        url, server = srv.url, srv.server
        lines: list[str] = []

        def stream():
            body = {"messages": HELLO, "max_tokens": 2000, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + URL, json=body, timeout=30) as response:
                lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 20
        while not lines and "qvl_busy 1" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.handle_exit(signal.SIGTERM, None)
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "shutting_down"}
        refused = httpx.post(url + URL, json={"messages": HELLO, "max_tokens": 1}, timeout=5)
        assert refused.status_code == 503 and error_code(refused) == "shutting_down"
        reader.join(20)
        assert not reader.is_alive(), "the stream hung after SIGTERM"
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down" and lines[-1] == "data: [DONE]"
        srv.thread.join(15)  # drained: uvicorn stops by itself
        assert not srv.thread.is_alive()
