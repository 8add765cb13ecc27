"""The state the routes share: the engine (loaded in the background),
its worker, the metrics."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from qvl.engine import Engine
from qvl.server.errors import APIError
from qvl.server.metrics import Metrics
from qvl.server.settings import ServerSettings
from qvl.server.worker import Worker

log = logging.getLogger("qvl.server")


class ServerState:
    def __init__(self, settings: ServerSettings, load: Callable[[], Engine]):
        self.settings, self.load = settings, load
        self.metrics = Metrics()
        self.engine: Engine | None = None  # set last: the readiness flag
        self.worker: Worker | None = None
        self.load_error: str | None = None
        self.shutting_down = False
        self.on_load_failure: Callable[[], None] | None = None  # the CLI stops the server
        self.started = int(time.time())

    def start(self) -> None:
        threading.Thread(target=self._load_engine, name="qvl-load", daemon=True).start()

    def _load_engine(self) -> None:
        try:
            engine = self.load()
        except Exception as exc:  # reported by /health and the log; the CLI exits
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s", self.load_error)
            if self.on_load_failure:
                self.on_load_failure()
            return
        worker = Worker(engine, self.settings.queue_size, self.metrics, warm_up=self.settings.warm_up)
        worker.start()
        self.worker, self.engine = worker, engine
        log.info("model %s ready (loaded in %.1f s)", engine.model_name, engine.load_s)

    def ready(self) -> tuple[Engine, Worker]:
        """The engine and its worker, or 503 while loading / after a failed load."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None or self.worker is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, message, code="model_not_ready", headers={"Retry-After": "5"})
        return self.engine, self.worker

    def health(self) -> tuple[int, dict]:
        if self.shutting_down:
            return 503, {"status": "shutting_down"}
        if self.engine is None:
            status = "failed" if self.load_error else "loading"
            return 503, {"status": status, **({"error": self.load_error} if self.load_error else {})}
        return 200, {"status": "ok", "model": self.engine.model_name, "load_s": round(self.engine.load_s, 3)}

    def gauges(self) -> dict[str, float]:
        worker = self.worker
        gauges = {
            "qvl_ready": float(self.engine is not None and not self.shutting_down),
            "qvl_queue_depth": worker.depth if worker else 0,
            "qvl_queue_capacity": self.settings.queue_size,
            "qvl_busy": float(worker.busy) if worker else 0,
        }
        if self.engine is not None:
            stats = self.engine.scheduler.stats()
            gauges.update({
                "qvl_running_requests": stats["running"],
                "qvl_max_batch": self.engine.scheduler.max_batch,
                "qvl_last_step_rows": stats["last_step_rows"],
                "qvl_last_step_seconds": stats["last_step_seconds"],
                "qvl_kv_cache_budget_bytes": stats["kv_budget_bytes"],
                "qvl_kv_cache_held_bytes": stats["kv_held_bytes"],
                "qvl_kv_cache_prefix_bytes": stats["kv_prefix_bytes"],
                "qvl_kv_cache_filled_bytes": stats["kv_filled_bytes"],
                "qvl_scheduler_preemptions": stats["preemptions"],
                "qvl_scheduler_steps": stats["steps"],
                "qvl_scheduler_tokens": stats["tokens"],
            })
        return gauges

    def cache_stats(self) -> dict:
        """Hits, misses, evictions and bytes of the engine's caches (empty while loading)."""
        e = self.engine
        if e is None:
            return {}
        return {"vision": e.vision_cache.stats, "prefix": e.prefix_cache.stats, "answer": e.answer_cache.stats}

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests, let in-flight ones finish within the grace period."""
        self.shutting_down = True
        if self.worker:
            self.worker.close(self.settings.shutdown_grace_s)

    def drained(self) -> bool:
        """Nothing running or waiting (after begin_shutdown: nothing will be)."""
        worker = self.worker
        return worker is None or worker.idle

    def stop(self) -> None:
        if self.worker:
            self.worker.stop()
