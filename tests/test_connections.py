"""Connections that hold the server's slots: clients that send their body too slowly while
the connections are full, and clients that take none of their answer. Live tests: qvl's
uvicorn server in a thread on 127.0.0.1, with small deadlines and socket buffers so they
take seconds."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx

from qvl.server.settings import ConnectionLimits
from tests.test_server_hardening import HELLO, URL, Client, head, live


def until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def upload_slowly(port: int, body: bytes, piece: int, every_s: float, answer: list[bytes]) -> None:
    """A client over a slow link: the head, then `piece` bytes every `every_s`; its answer
    (read to the end) into `answer`."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head(port, len(body)) + b"Connection: close\r\n\r\n")
        for i in range(0, len(body), piece):
            time.sleep(every_s)
            sock.sendall(body[i : i + piece])
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
        answer.append(received)


def test_slow_body_senders_cannot_lock_out_new_requests(tiny_engine):
    """63 clients send a complete head and one body byte, a 64th uploads slowly but steadily:
    every connection is busy receiving a body. A new request gets served (the slowest sender
    makes room, with 408), and the steady upload still completes."""
    limits = ConnectionLimits(header_timeout_s=60, body_timeout_s=60)  # the default 64 connections
    with live(tiny_engine, limits) as srv:
        connections = srv.server.server_state.connections
        stalled = [Client(srv.port, head=head(srv.port, 1000) + b"\r\n{") for _ in range(63)]
        until(lambda: sum(c.in_request for c in list(connections)) == 63)
        body = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
        answer: list[bytes] = []
        uploader = threading.Thread(target=upload_slowly, args=(srv.port, body, 4, 0.15, answer))
        uploader.start()
        until(lambda: sum(c.in_request for c in list(connections)) == 64)
        time.sleep(1.2)  # every head is older than the grace a young upload gets
        try:
            response = httpx.post(srv.url + URL, json={"messages": HELLO, "max_tokens": 2}, timeout=30)
            assert response.status_code == 200, response.text
            uploader.join(30)
            assert answer and answer[0].startswith(b"HTTP/1.1 200"), answer
            for c in stalled:
                c.tick()
            evicted = [c for c in stalled if c.received.startswith(b"HTTP/1.1 408")]
            assert evicted and all(c.closed_after is not None for c in evicted)
        finally:
            for c in stalled:
                c.sock.close()


def test_a_client_that_reads_nothing_is_cut_off_and_its_request_cancelled(tiny_engine):
    """A streamed answer nobody reads fills the socket buffers: after --write-timeout the
    connection is aborted, its generation cancelled, and its slot serves the next client
    (while it was being answered, a newcomer got 503: answered requests are never evicted)."""
    limits = ConnectionLimits(max_connections=1, write_timeout_s=1.0)
    with live(tiny_engine, limits, send_buffer=4096) as srv:
        connections = srv.server.server_state.connections
        body = json.dumps({"messages": HELLO, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "n": 4,
                           "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
        deaf = socket.socket()
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.connect(("127.0.0.1", srv.port))
        deaf.sendall(head(srv.port, len(body)) + b"\r\n" + body)
        refused = None
        try:
            until(lambda: len(connections) == 1 and next(iter(connections)).in_request)
            refused = Client(srv.port)
            until(lambda: (refused.tick(), refused.closed_after)[1] is not None, 5)
            assert refused.received.startswith(b"HTTP/1.1 503")
            until(lambda: not connections, 30)  # old code: held until the 2,000 tokens were taken
            response = httpx.post(srv.url + URL, json={"messages": HELLO, "max_tokens": 1}, timeout=30)
            assert response.status_code == 200, response.text
            metrics = httpx.get(srv.url + "/metrics", timeout=10).text
            assert re.search(r'qvl_cancelled_total\{reason="disconnect"\} 1\b', metrics), metrics
        finally:
            deaf.close()
            if refused is not None:
                refused.sock.close()


def test_write_timeout_flag():
    from qvl.cli import build_parser
    from qvl.server.cli import settings

    parser, _ = build_parser()
    assert settings(parser.parse_args(["serve", "--write-timeout", "3"])).connections.write_timeout_s == 3
    assert settings(parser.parse_args(["serve"])).connections.write_timeout_s == 30


def test_a_client_that_just_connected_is_not_dropped_for_a_slow_sender(tiny_engine):
    """Connections full of stalled body senders, and one client connected an instant ago that
    has not sent its head yet: a newcomer evicts a stalled sender (408), not the fresh client,
    which then gets its answer."""
    limits = ConnectionLimits(max_connections=3, header_timeout_s=30, body_timeout_s=30)
    with live(tiny_engine, limits) as srv:
        connections = srv.server.server_state.connections
        stalled = [Client(srv.port, head=head(srv.port, 1000) + b"\r\n{") for _ in range(2)]
        until(lambda: sum(c.in_request for c in list(connections)) == 2)
        time.sleep(1.2)  # the stalled heads are past the grace a young upload gets
        fresh = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        until(lambda: len(connections) == 3)
        newcomer = Client(srv.port)
        until(lambda: any((c.tick(), c.closed_after)[1] is not None for c in stalled))
        assert sum(c.received.startswith(b"HTTP/1.1 408") for c in stalled) == 1
        body = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
        fresh.sendall(head(srv.port, len(body)) + b"Connection: close\r\n\r\n" + body)
        received = b""
        while chunk := fresh.recv(4096):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        for c in [*stalled, newcomer]:
            c.sock.close()
        fresh.close()
