"""The models a server serves, by name. Each model gets a worker of its own when it is loaded
(one scheduler, its own KV pool and caches) and every request is routed to its model's worker.

A server of one model loads it at start and answers whatever model name a client sends. A
server of several loads each on its first request; requests for a model being loaded wait for
that load (one load for all of them), and a load that fails answers them with its reason.
A request holds its model (a `Lease`) until it is answered: a held model is never unloaded.
A model nobody holds is unloaded once its keep-alive has passed (the last request's, else the
server's), or sooner when a model being loaded needs its room under --max-loaded or
--max-memory: the least recently used idle one first. When every model that would have to go
is answering requests, the load waits for one to finish, up to the request time limit, then
answers 503 naming the models and the limit.

One thread, "qvl-models", loads and unloads, one model at a time. The counts it decides on
(leases, expiry) are changed under one lock from the event loop and from that thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from qvl.cache import CacheStats
from qvl.config import ModelConfig
from qvl.engine import Engine, EngineOptions, chosen_weights
from qvl.hub import default_model, local_model
from qvl.kernels.library import library
from qvl.models import SHORT_NAMES, short_name
from qvl.server.errors import APIError
from qvl.server.memory import release
from qvl.server.metrics import Metrics
from qvl.server.settings import ServerSettings
from qvl.server.worker import Worker
from qvl.weights import checkpoint_quantization

log = logging.getLogger("qvl.server")
DEFAULT = object()  # a request that sets no keep_alive: the server's applies
GB = 1e9


def served_name(model: str | None) -> str:
    """What clients call a model given as a folder (its name) or a hub id or short name (as given)."""
    text = model or default_model()
    path = Path(text).expanduser()
    return path.resolve().name if path.is_dir() else text


@dataclass(frozen=True)
class ModelSource:
    """A model the server may serve."""

    load: Callable[[], Engine]
    name: str | None = None  # what clients call it; None: the engine's own name (a server of one model)
    options: EngineOptions | None = None  # what `load` loads, when known: its files before it is loaded

    @classmethod
    def of(cls, options: EngineOptions, name: str | None = None) -> ModelSource:
        """Engine.load(options), called `name` (else served_name of its folder or hub id)."""
        options = replace(options, name=name or served_name(options.model))
        return cls(partial(Engine.load, options), options.name, options)


class Model:
    """One model of the registry: loaded (engine and worker) or not, and who holds it."""

    def __init__(self, source: ModelSource, keep_alive_s: float | None):
        self.source = source
        self.name = source.name  # a nameless source takes its engine's name when first loaded
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.loading: Future | None = None  # the load requests wait for
        self.error: str | None = None  # why the last load failed
        self.leases = 0  # requests holding it
        self.keep_alive_s = keep_alive_s  # set by each request; None: never unloaded for being idle
        self.last_used = 0.0  # time.monotonic() of its last request's start or end
        self.expires: float | None = None  # idle and loaded: when it is unloaded
        self.weight_bytes = 0  # its tensors, counted once loaded
        self.loaded_path: Path | None = None  # the checkpoint folder it was last loaded from

    def answers_to(self, name: str) -> bool:
        """Its name, case aside, with or without Ollama's ':latest'; for a hub id, its short name too."""
        wanted = name.strip().lower().removesuffix(":latest")
        names = {self.name or ""}
        given = self.source.options.model if self.source.options else None
        if given and not Path(given).expanduser().is_dir():
            hub = SHORT_NAMES.get(given.lower(), given)
            names |= {hub, short_name(hub) or ""}
        return wanted in {n.lower() for n in names if n}

    @property
    def path(self) -> Path | None:
        """Its checkpoint folder: where it was loaded from, else where it would be (None: not on disk)."""
        if self.loaded_path is not None:
            return self.loaded_path
        return local_model(self.source.options.model) if self.source.options else None

    @property
    def weights(self) -> str:
        """The weight format it runs in, or will once loaded, as Engine.weights names it (int8,
        int4-g128, bfloat16, float32)."""
        if self.engine is not None:
            return self.engine.weights
        options, path = self.source.options or EngineOptions(), self.path
        try:
            stored = checkpoint_quantization(path) if path else None
        except (OSError, ValueError):
            stored = None
        chosen = chosen_weights(options.weights, stored)
        if chosen == "int4":
            return f"int4-g{stored.group_size if stored else options.group_size}"
        return {"bf16": "bfloat16", "fp32": "float32"}.get(chosen, chosen)

    def held_bytes(self) -> int:
        """What the loaded model holds: its tensors, the KV blocks written so far, the vision cache."""
        engine = self.engine
        if engine is None:
            return 0
        pool = engine.scheduler.pool
        return self.weight_bytes + pool.fresh * pool.block_bytes + engine.vision_cache.stats.bytes


class Lease:
    """A request's hold on its loaded model: it is not unloaded before `release` (idempotent)."""

    def __init__(self, registry: Registry, model: Model):
        self.registry, self.model = registry, model
        self.engine, self.worker = model.engine, model.worker
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released, self.engine, self.worker = True, None, None
            self.registry.release(self.model)


class Registry:
    def __init__(self, sources: Sequence[ModelSource], settings: ServerSettings, metrics: Metrics):
        names = [s.name.lower() for s in sources if s.name]
        if not sources:
            raise ValueError("a server needs at least one model")
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"two models are called {', '.join(dupes)}: give each its own name (--model NAME=PATH)")
        self.settings, self.metrics = settings, metrics
        self.models = [Model(s, settings.models.keep_alive_s) for s in sources]
        self.single = len(self.models) == 1  # answers every name; loaded at start
        self.cond = threading.Condition()
        self.pending: deque[Model] = deque()  # loads asked for, in order
        self.closing = self.stopped = False
        self.starting = self.single  # the start-up load of a server of one model is under way
        self.start_error: str | None = None  # ... and failed: why
        self.on_start_failure: Callable[[], None] | None = None  # the CLI stops the server
        self.thread = threading.Thread(target=self._run, name="qvl-models", daemon=True)

    def start(self) -> None:
        if self.single:
            with self.cond:
                self._load_soon(self.models[0])
        self.thread.start()

    def wait_started(self) -> None:
        """Block until the start-up load is done; RuntimeError naming why it failed."""
        with self.cond:
            self.cond.wait_for(lambda: not self.starting)
        if self.start_error:
            raise RuntimeError(self.start_error)

    # -- requests (on the event loop) ----------------------------------------------------------

    def find(self, name: str | None) -> Model:
        """The model a request names; a server of one answers every name, no name means the
        first model. 404 naming the models served otherwise."""
        if self.single or not name:
            return self.models[0]
        for model in self.models:
            if model.answers_to(name):
                return model
        raise APIError(404, f"model '{name}' not found: this server serves {', '.join(self.names())}", "model",
                       "model_not_found")

    def names(self) -> list[str]:
        return [m.name for m in self.models if m.name]

    async def acquire(self, name: str | None, keep_alive: object = DEFAULT) -> Lease:
        """Hold the named model, loaded (waiting for its load); keep_alive (seconds, None:
        forever, DEFAULT: the server's) applies once nobody holds it."""
        model = self.find(name)
        with self.cond:
            if self.closing:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            model.leases += 1
            model.keep_alive_s = self.settings.models.keep_alive_s if keep_alive is DEFAULT else keep_alive
            model.last_used, model.expires = time.monotonic(), None
            loading = self._load_soon(model) if model.engine is None else None
        if loading is not None:
            try:
                await asyncio.shield(asyncio.wrap_future(loading))
            except BaseException as exc:
                self.release(model)
                if isinstance(exc, APIError):  # each waiter its own copy: a raised error keeps its traceback
                    raise APIError(exc.status, exc.message, exc.param, exc.code, exc.headers) from None
                raise
        return Lease(self, model)

    def release(self, model: Model) -> None:
        with self.cond:
            model.leases -= 1
            model.last_used = time.monotonic()
            if model.leases == 0 and model.engine is not None and model.keep_alive_s is not None:
                model.expires = model.last_used + model.keep_alive_s
            self.cond.notify_all()

    # -- the models thread ---------------------------------------------------------------------

    def _load_soon(self, model: Model) -> Future:
        """The load of `model` (asked for now unless already asked for); call under the lock."""
        if model.loading is None:
            model.loading = Future()
            self.pending.append(model)
            self.cond.notify_all()
        return model.loading

    def _expired(self) -> list[Model]:
        now = time.monotonic()
        return [m for m in self.models if m.leases == 0 and m.expires is not None and m.expires <= now]

    def _next_expiry(self) -> float | None:
        due = [m.expires for m in self.models if m.leases == 0 and m.expires is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self.stopped or self.pending or self._expired()):
                    self.cond.wait(self._next_expiry())  # woken by every request's start and end
                if self.stopped:
                    return
                expired = self._expired()
                model = self.pending.popleft() if self.pending and not expired else None
            for idle in expired:
                self._unload(idle, "its keep-alive passed")
            if model is not None:
                self._load(model)

    def _load(self, model: Model) -> None:
        started = time.perf_counter()
        try:
            self._make_room(model)
            engine = model.source.load()
            worker = Worker(engine, self.settings.queue_size, self.metrics, warm_up=self.settings.warm_up and self.starting)
            worker.start()
        except Exception as exc:
            failure = exc if isinstance(exc, APIError) else load_failure(model, exc)  # APIError: no room
            exc = None  # its traceback holds the half-built engine's frames
            with self.cond:
                loading, model.loading = model.loading, None
                model.error = failure.message if failure.code == "model_load_failed" else model.error
                self._started(failure.message)
            loading.set_exception(failure)
            return
        with self.cond:
            if self.closing:
                worker.close(0)
            model.engine, model.worker, model.error = engine, worker, None
            model.name = model.name or engine.model_name
            model.loaded_path, model.weight_bytes = engine.path, tensor_bytes(engine.model)
            loading, model.loading = model.loading, None
            self._started(None)
        log.info("model %s loaded in %.1f s (%.2f GB)", model.name, time.perf_counter() - started,
                 model.weight_bytes / GB)
        loading.set_result(None)

    def _started(self, error: str | None) -> None:
        """The start-up load ended (call under the lock)."""
        if not self.starting:
            return
        self.starting, self.start_error = False, error
        self.cond.notify_all()
        if error is not None and self.on_start_failure:
            self.on_start_failure()

    def _make_room(self, model: Model) -> None:
        """Unload idle models, least recently used first, until `model` fits the limits; while
        only models answering requests could go, wait for one of them (up to the request time
        limit, then 503)."""
        limits = self.settings.models
        if limits.max_loaded is None and limits.max_memory_bytes is None:
            return
        need = expected_bytes(model) if limits.max_memory_bytes is not None else 0
        deadline = time.monotonic() + self.settings.time_limit_s
        while True:
            with self.cond:
                others = [m for m in self.models if m.engine is not None and m is not model]
                reason = self._over_limits(model, others, need)
                if reason is None or not others:
                    return
                idle = [m for m in others if m.leases == 0]
                victim = min(idle, key=lambda m: m.last_used) if idle else None
                if victim is None:
                    if self.closing or time.monotonic() >= deadline:
                        raise APIError(503, f"model '{model.name}' cannot be loaded now: {reason}, and every loaded "
                                            f"model is answering requests ({', '.join(m.name for m in others)}); "
                                            "retry later", "model", "models_busy", headers={"Retry-After": "5"})
                    self.cond.wait(deadline - time.monotonic())
                    continue
            self._unload(victim, f"to make room for {model.name}")

    def _over_limits(self, model: Model, others: list[Model], need: int) -> str | None:
        limits = self.settings.models
        if limits.max_loaded is not None and len(others) + 1 > limits.max_loaded:
            return f"{len(others)} models are loaded and --max-loaded is {limits.max_loaded}"
        held = sum(m.held_bytes() for m in others)
        if limits.max_memory_bytes is not None and held + need > limits.max_memory_bytes:
            return (f"the loaded models hold {held / GB:.2f} GB and {model.name} needs about {need / GB:.2f} GB, "
                    f"over --max-memory {limits.max_memory_bytes / GB:.2f} GB")
        return None

    def _unload(self, model: Model, why: str) -> None:
        """Stop its worker and let go of its engine, unless a request took it meanwhile; then
        the memory goes back to the system."""
        with self.cond:
            if model.engine is None or model.leases:
                return
            engine, worker = model.engine, model.worker
            model.engine = model.worker = model.expires = None
            model.weight_bytes = 0
        worker.stop()
        engine.close()  # freed once the last request that used it is done with it
        engine = worker = None
        release()
        log.info("model %s unloaded (%s)", model.name, why)

    # -- the server's life ---------------------------------------------------------------------

    def loaded(self) -> list[Model]:
        return [m for m in self.models if m.engine is not None]

    def engines(self) -> list[tuple[Engine, Worker]]:
        """The loaded models' engines and workers, each pair taken together."""
        with self.cond:
            return [(m.engine, m.worker) for m in self.models if m.engine is not None]

    def close(self, grace_s: float) -> None:
        """Shutdown, step 1: refuse new requests; running ones may finish within `grace_s`."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        for _, worker in self.engines():
            worker.close(grace_s)

    def drained(self) -> bool:
        """Nothing running, waiting or held (after close: nothing will be)."""
        with self.cond:
            return all(m.leases == 0 and (m.worker is None or m.worker.idle) for m in self.models)

    def stop(self) -> None:
        """Shutdown, step 2: end every worker and the models thread."""
        with self.cond:
            self.closing = self.stopped = True
            self.cond.notify_all()
        for _, worker in self.engines():
            worker.stop()
        if self.thread.is_alive():
            self.thread.join(10)

    def gauges(self) -> dict[str, float]:
        """The workers' and schedulers' numbers, summed over the loaded models."""
        loaded = self.engines()
        gauges = {"qvl_models_loaded": len(loaded),
                  "qvl_queue_depth": sum(worker.depth for _, worker in loaded),
                  "qvl_queue_capacity": self.settings.queue_size,
                  "qvl_busy": float(any(worker.busy for _, worker in loaded))}
        if not loaded:
            return gauges
        stats = [engine.scheduler.stats() for engine, _ in loaded]
        total = {key: sum(s[key] for s in stats) for key in stats[0]}
        done, taken = library().team_counts()
        return gauges | loaded[0][0].threads.stats() | {
            "qvl_kernel_items": done, "qvl_kernel_items_taken_over": taken,
            "qvl_running_requests": total["running"],
            "qvl_max_batch": sum(engine.scheduler.max_batch for engine, _ in loaded),
            "qvl_last_step_rows": total["last_step_rows"],
            "qvl_last_step_seconds": max(s["last_step_seconds"] for s in stats),
            "qvl_kv_cache_budget_bytes": total["kv_budget_bytes"],
            "qvl_kv_cache_held_bytes": total["kv_held_bytes"],
            "qvl_kv_cache_prefix_bytes": total["kv_prefix_bytes"],
            "qvl_kv_cache_filled_bytes": total["kv_filled_bytes"],
            "qvl_scheduler_preemptions": total["preemptions"],
            "qvl_scheduler_steps": total["steps"],
            "qvl_scheduler_tokens": total["tokens"],
        }

    def cache_stats(self) -> dict[str, CacheStats]:
        """Hits, misses, evictions and bytes of the loaded models' caches, summed (empty with none)."""
        per_model = [{"vision": engine.vision_cache.stats, "prefix": engine.prefix_cache.stats,
                      "answer": engine.answer_cache.stats} for engine, _ in self.engines()]
        if not per_model:
            return {}
        return {cache: CacheStats(**{f.name: sum(getattr(s[cache], f.name) for s in per_model)
                                     for f in fields(CacheStats)}) for cache in per_model[0]}


def load_failure(model: Model, exc: Exception) -> APIError:
    """503 naming the model and why its load failed (logged with the traceback)."""
    name = f"model '{model.name}'" if model.name else "the model"
    log.error("loading %s failed", name, exc_info=exc)
    return APIError(503, f"{name} failed to load: {type(exc).__name__}: {exc}", "model", "model_load_failed")


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of the tensors a model's modules hold (parameters, buffers, packed copies of
    weights), each storage counted once."""
    sizes: dict[int, int] = {}
    for m in module.modules():
        for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                storage = t.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's packed weights)
                sizes[id(t)] = t.numel() * t.element_size()
    return sum(sizes.values())


def expected_bytes(model: Model) -> int:
    """What a model not loaded yet will hold once loaded, from its config (qvl.sizing); 0 when
    its files cannot tell."""
    from qvl.sizing import FORMATS, footprint

    path = model.path
    if path is None:
        return 0
    weights = {"bfloat16": "bf16", "float32": "fp32"}.get(model.weights, model.weights.partition("-")[0])
    try:
        cfg = ModelConfig.from_file(path / "config.json")
        return footprint(cfg, weights if weights in FORMATS else "bf16").total_bytes * (2 if weights == "fp32" else 1)
    except Exception:  # an unreadable config: the load will say what is wrong
        return 0
