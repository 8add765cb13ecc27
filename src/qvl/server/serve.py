"""Run the app under uvicorn, with SIGTERM handled so no request is left hanging."""

from __future__ import annotations

import time

import uvicorn
from fastapi import FastAPI

from qvl.server.connections import GuardedH11Protocol
from qvl.server.state import ServerState

DRAIN_SLACK_S = 5.0  # past the grace period, how long the last cancelled answers may take to go out


class Server(uvicorn.Server):
    """uvicorn's server, telling qvl about SIGTERM/SIGINT first. The server keeps accepting
    connections while in-flight work drains, so new requests and /health get 503 (not a
    refused connection); running requests may finish within the grace period, then end
    with an error; then uvicorn stops listening and waits for the connections to close.
    A second Ctrl-C stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.drain_until: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_until is not None or self.should_exit:  # a second signal: stop draining
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # uvicorn re-raises it once it has shut down
        self.state.begin_shutdown()
        self.drain_until = time.monotonic() + self.state.settings.shutdown_grace_s + DRAIN_SLACK_S

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.drain_until is not None and (self.state.drained() or time.monotonic() > self.drain_until)

    def request_exit(self) -> None:
        self.should_exit = True


def config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    state: ServerState = app.state.qvl
    limits = state.settings.connections
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=GuardedH11Protocol.factory(limits),
                          ws="none", timeout_keep_alive=limits.keep_alive_s,
                          timeout_graceful_shutdown=state.settings.shutdown_grace_s + DRAIN_SLACK_S)


def run(app: FastAPI, host: str, port: int, log_level: str) -> int:
    """Serve until SIGTERM/SIGINT; 1 when the model failed to load."""
    state: ServerState = app.state.qvl
    server = Server(config(app, host, port, log_level), state)
    state.models.on_start_failure = server.request_exit
    server.run()
    return 1 if state.models.start_error else 0
