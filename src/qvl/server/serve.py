"""Run the app under uvicorn, with SIGTERM handled so no request is left hanging."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from qvl.server.state import ServerState


class Server(uvicorn.Server):
    """uvicorn's server, telling qvl about SIGTERM/SIGINT first: new requests get 503 at once,
    running ones may finish within the grace period, then end with an error; uvicorn then
    waits for the connections to close."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.begin_shutdown()
        super().handle_exit(sig, frame)

    def request_exit(self) -> None:
        self.should_exit = True


def run(app: FastAPI, host: str, port: int, log_level: str, max_connections: int) -> int:
    """Serve until SIGTERM/SIGINT; 1 when the model failed to load."""
    state: ServerState = app.state.qvl
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, limit_concurrency=max_connections,
                            timeout_graceful_shutdown=state.settings.shutdown_grace_s + 5)
    server = Server(config, state)
    state.on_load_failure = server.request_exit
    server.run()
    return 1 if state.load_error else 0
