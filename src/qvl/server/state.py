"""The state the routes share: the models (registry.py: each loaded with a worker of its
own), the metrics, whether the server is shutting down."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from qvl.engine import Engine
from qvl.server.errors import APIError
from qvl.server.metrics import Metrics
from qvl.server.registry import DEFAULT, Lease, ModelSource, Registry
from qvl.server.settings import ServerSettings


class ServerState:
    def __init__(self, settings: ServerSettings, models: Callable[[], Engine] | Sequence[ModelSource]):
        """models: the sources of the models served, or one function that loads the only one."""
        self.settings = settings
        self.metrics = Metrics()
        self.models = Registry([ModelSource(models)] if callable(models) else models, settings, self.metrics)
        self.shutting_down = False
        self.started = int(time.time())

    def start(self) -> None:
        self.models.start()

    def ready(self) -> None:
        """503 while shutting down, and in a server of one model while it is first loading or
        after that failed (as /health says)."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.models.start_error:
            raise APIError(503, self.models.start_error, code="model_not_ready")
        if self.models.starting:
            raise APIError(503, "the model is loading", code="model_not_ready", headers={"Retry-After": "5"})

    async def acquire(self, name: str | None, keep_alive: object = DEFAULT) -> Lease:
        """The named model held for one request, loaded (see Registry.acquire)."""
        self.ready()
        return await self.models.acquire(name, keep_alive)

    def health(self) -> tuple[int, dict]:
        if self.shutting_down:
            return 503, {"status": "shutting_down"}
        if self.models.starting:
            return 503, {"status": "loading"}
        if self.models.single:
            model = self.models.models[0]
            if model.error:  # its last load failed (at start: the process is exiting)
                return 503, {"status": "failed", "error": model.error}
            load_s = {"load_s": round(model.engine.load_s, 3)} if model.engine is not None else {}
            return 200, {"status": "ok", "model": model.name, **load_s}
        return 200, {"status": "ok", "models": [{"name": m.name, "loaded": m.engine is not None,
                                                 **({"error": m.error} if m.error else {})}
                                                for m in self.models.models]}

    def gauges(self) -> dict[str, float]:
        ready = not (self.shutting_down or self.models.starting or self.models.start_error)
        return {"qvl_ready": float(ready), **self.models.gauges()}

    def cache_stats(self) -> dict:
        return self.models.cache_stats()

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests, let in-flight ones finish within the grace period."""
        self.shutting_down = True
        self.models.close(self.settings.shutdown_grace_s)

    def drained(self) -> bool:
        """Nothing running or waiting (after begin_shutdown: nothing will be)."""
        return self.models.drained()

    def stop(self) -> None:
        self.models.stop()
