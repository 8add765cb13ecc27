"""uvicorn's h11 protocol with deadlines for reading requests and writing answers, and a
bound on open connections.

uvicorn times out idle keep-alive connections only after an answer, and only until the next
byte arrives; a client that never completes its request head or body holds its connection
forever, and silent connections count against the connection limit until nobody else gets
in. Here every connection has one read deadline at a time:

- waiting for a request head: `header_timeout_s` from the connection's start or the previous
  answer's end (keep-alive idling, `keep_alive_s`, stays uvicorn's);
- receiving the body: `body_timeout_s` from the head;
- no read deadline while the answer is produced and sent (`--request-timeout` bounds that).

A connection past its read deadline gets `408` when no answer has started, and is closed.

Writing has its own deadline: a client that stops taking what it is sent (the transport's
buffer stays above its high-water mark, so uvicorn pauses the answer, or unsent bytes are
left when the connection closes) for `write_timeout_s` is cut off (aborted): the app sees
a disconnect and the request's job is cancelled.

When a new connection would pass `max_connections`, room is made: first by closing the
connection that has waited longest without a request in progress (one idle for less than
`FRESH_S` is given that time to send its head: a client that has just connected is not
dropped for a slow sender), else the one sending its request body most slowly (bytes per
second since its head; a head younger than `BODY_RATE_GRACE_S` counts as fast) gets `408`,
else the longest idle after all. Only when every other connection is being answered does
the new one get `503`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math

from uvicorn.protocols.http.h11_impl import H11Protocol

from qvl.server.settings import ConnectionLimits

log = logging.getLogger("qvl.server")

BODY_RATE_GRACE_S = 1.0  # a body sender is judged by its rate only once its head is this old
FRESH_S = 1.0  # a connection without a request is evicted before a body sender only once idle this long


def plain_response(status: str, message: str) -> bytes:
    body = (message + "\n").encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.deadline: asyncio.TimerHandle | None = None  # for reading (head, body)
        self.stall: asyncio.TimerHandle | None = None  # for writing: armed while its answer waits unsent
        self.idle_since = self.loop.time()
        self.body_since = self.idle_since  # when the current request's head arrived
        self.body_bytes = 0  # bytes received since

    @classmethod
    def factory(cls, limits: ConnectionLimits):
        """What uvicorn.Config(http=...) takes: a protocol class bound to these limits."""
        return functools.partial(cls, limits=limits)

    @property
    def in_request(self) -> bool:
        """A request head has arrived and its answer is not complete yet."""
        return self.cycle is not None and not self.cycle.response_complete

    @property
    def receiving_body(self) -> bool:
        """A request head has arrived, its body has not, and no answer has started."""
        return self.in_request and self.cycle.more_body and not self.cycle.response_started

    def body_rate(self, now: float) -> float:
        """Bytes per second received since the head (inf while the head is young)."""
        elapsed = now - self.body_since
        return self.body_bytes / elapsed if elapsed >= BODY_RATE_GRACE_S else math.inf

    # -- uvicorn's protocol hooks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        self._arm(self.limits.header_timeout_s, "the request head")
        if self._open_connections() > self.limits.max_connections and not self._make_room():
            log.warning("every connection is being answered (--max-connections %d): refusing a new one",
                        self.limits.max_connections)
            self._close(plain_response("503 Service Unavailable", "too many connections"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unwatch_writes()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.receiving_body:
            self.body_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        waiting_for_head = not self.in_request
        super().handle_events()
        if self.transport.is_closing():
            return
        if waiting_for_head and self.in_request:  # a head arrived: now its body has a deadline
            self.body_since, self.body_bytes = self.loop.time(), 0
            if self.cycle.more_body:
                self._arm(self.limits.body_timeout_s, "the request body")
            else:
                self._disarm()
        elif self.in_request and not self.cycle.more_body:  # the body is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():  # closed after the answer: its last bytes must still be taken
            self._watch_writes_if_unsent()
            return
        self.idle_since = self.loop.time()
        if not self.in_request:  # not a pipelined request started by the call above
            self._arm(self.limits.header_timeout_s, "the request head")

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._watch_writes_if_unsent()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unwatch_writes()
        if self.transport.is_closing():  # it took some: the rest has a deadline of its own
            self._watch_writes_if_unsent()

    # -- deadlines and eviction -------------------------------------------------------------

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, self._expire, seconds, what)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self, seconds: float, what: str) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.in_request and self.cycle.response_started:
            return  # an answer is on its way: the request's own time limit applies
        log.debug("%s:%s sent no complete %s within %g s: closing", *(self.client or ("?", "?")), what, seconds)
        self._close(plain_response("408 Request Timeout", f"{what} took longer than {seconds:g} s"))

    def _watch_writes(self) -> None:
        if self.stall is None:
            self.stall = self.loop.call_later(self.limits.write_timeout_s, self._stalled)

    def _watch_writes_if_unsent(self) -> None:
        if self.transport.get_write_buffer_size():
            self._watch_writes()

    def _unwatch_writes(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _stalled(self) -> None:
        """What it was sent stayed unsent for write_timeout_s: cut it off (its request sees it gone)."""
        self.stall = None
        if self.transport.get_write_buffer_size():
            log.info("%s:%s took too little of its answer for %g s: cutting it off", *(self.client or ("?", "?")),
                     self.limits.write_timeout_s)
            self.transport.abort()

    def _close(self, response: bytes | None) -> None:
        """Answer (when given) and close; a request in progress sees its client gone."""
        self._disarm()
        if response is not None:
            if self.in_request:  # the app's own answer would come too late: drop it
                self.cycle.response_started = True
            self.transport.write(response)
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # a client that does not read must not keep the socket either
        else:
            self.transport.close()

    def _open_connections(self) -> int:
        return sum(not c.transport.is_closing() for c in self.connections if c.transport is not None)

    def _make_room(self) -> bool:
        """Close the connection that has waited longest without a request (one that opened or
        was answered under a second ago is given that second to send its head), else the
        slowest body sender (408), else the longest idle; False if every other connection is
        being answered."""
        others = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                  and not c.transport.is_closing()]
        now = self.loop.time()
        idle = [c for c in others if not c.in_request]
        waited = [c for c in idle if now - c.idle_since >= FRESH_S]
        if waited:
            min(waited, key=lambda c: c.idle_since)._close(None)
            return True
        senders = [c for c in others if c.receiving_body]
        if senders:
            slowest = min(senders, key=lambda c: (c.body_rate(now), c.body_since))
            log.debug("%s:%s sends its body slowest (%d bytes in %.1f s) and the connections are full: closing",
                      *(slowest.client or ("?", "?")), slowest.body_bytes, now - slowest.body_since)
            slowest._close(plain_response("408 Request Timeout", "the request body arrived too slowly while the "
                                                                 "server needed the connection for another client"))
            return True
        if idle:
            min(idle, key=lambda c: c.idle_since)._close(None)
            return True
        return False
