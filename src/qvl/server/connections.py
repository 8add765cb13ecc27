"""uvicorn's h11 protocol with deadlines for reading requests and a bound on open connections.

uvicorn times out idle keep-alive connections only after an answer, and only until the next
byte arrives; a client that never completes its request head or body holds its connection
forever, and silent connections count against the connection limit until nobody else gets
in. Here every connection has one deadline at a time:

- waiting for a request head: `header_timeout_s` from the connection's start or the previous
  answer's end (keep-alive idling, `keep_alive_s`, stays uvicorn's);
- receiving the body: `body_timeout_s` from the head;
- no deadline while the answer is produced and sent (`--request-timeout` bounds that).

A connection past its deadline gets `408` when no answer has started, and is closed.
When a new connection would pass `max_connections`, the connection that has waited longest
without a request in progress is closed to make room; if every connection carries a request,
the new one gets `503` and is closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from qvl.server.settings import ConnectionLimits

log = logging.getLogger("qvl.server")


def plain_response(status: str, message: str) -> bytes:
    body = (message + "\n").encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.deadline: asyncio.TimerHandle | None = None
        self.idle_since = self.loop.time()

    @classmethod
    def factory(cls, limits: ConnectionLimits):
        """What uvicorn.Config(http=...) takes: a protocol class bound to these limits."""
        return functools.partial(cls, limits=limits)

    @property
    def in_request(self) -> bool:
        """A request head has arrived and its answer is not complete yet."""
        return self.cycle is not None and not self.cycle.response_complete

    # -- uvicorn's protocol hooks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        self._arm(self.limits.header_timeout_s, "the request head")
        if self._open_connections() > self.limits.max_connections and not self._make_room():
            log.warning("every connection carries a request (--max-connections %d): refusing a new one",
                        self.limits.max_connections)
            self._close(plain_response("503 Service Unavailable", "too many connections"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        waiting_for_head = not self.in_request
        super().handle_events()
        if self.transport.is_closing():
            return
        if waiting_for_head and self.in_request:  # a head arrived: now its body has a deadline
            if self.cycle.more_body:
                self._arm(self.limits.body_timeout_s, "the request body")
            else:
                self._disarm()
        elif self.in_request and not self.cycle.more_body:  # the body is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.idle_since = self.loop.time()
            if not self.in_request:  # not a pipelined request started by the call above
                self._arm(self.limits.header_timeout_s, "the request head")

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
        """Close the connection that has waited longest without a request; False if none."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                and not c.in_request and not c.transport.is_closing()]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since)
        victim._close(None)
        return True
