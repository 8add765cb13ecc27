"""`qvl serve --ray`: the same API and web page, answered by qvl replicas on Ray Serve.

Three deployments make one application:
- Replica (N of them, autoscaled or fixed): one engine with its scheduler, running the very
  app `qvl serve` runs (create_app): requests reach it as ASGI calls, so every route, error
  shape, limit and stream is the single-process code. Its answer streams back as ASGI pieces.
- Front (the HTTP ingress behind Ray Serve's proxy): reads the body (the body limit), keys
  it by content (affinity.routing_key) and relays it through a handle whose router
  (ray_router.ContentRouter) sends equal keys to the same replica. It answers /health and
  /metrics for the whole cluster from the Board.
- Board: where replicas post their metrics and health every REPORT_EVERY_S.

A replica that dies before its answer started is replaced by a second try on another
replica; one that dies mid-stream ends the stream with the route's own error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from qvl.server.affinity import routing_key
from qvl.server.errors import APIError, internal, is_ollama
from qvl.server.guard import SECURITY_HEADERS, BrowserGuard, matching_key
from qvl.server.metrics import Metrics, merge_texts
from qvl.server.settings import ServerSettings
from qvl.server.submit import read_body

APP = "qvl"
KEYED = ("/v1/", "/api/", "/metrics")  # the routes behind --api-key (app.py's API router)
REPORT_EVERY_S = 2.0  # replicas post metrics and health this often
STALE_S = 3 * REPORT_EVERY_S  # a report older than this is a replica that is gone
REPLICA_HEADER = "x-qvl-replica"  # which replica answered (its Ray Serve id), on every relayed answer
REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
ROUTERS = {"content": "qvl.server.ray_router:ContentRouter",
           "round-robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter", "pow-2": None}
log = logging.getLogger("qvl.server")


@dataclass(frozen=True)
class Scale:
    """How many replicas and what each reserves."""

    replicas: int = 1  # fixed count (ignored when max_replicas is set)
    min_replicas: int | None = None
    max_replicas: int | None = None  # set: autoscale between min and max
    cpus: int = 1  # CPUs each replica reserves (= its engine's threads)
    router: str = "content"  # or a baseline to compare with: "round-robin", "pow-2" (Ray Serve's default)

    def __post_init__(self):
        if self.replicas < 1 or self.cpus < 1:
            raise ValueError("--replicas and the CPUs per replica must be >= 1")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}: one of {', '.join(ROUTERS)}")
        if self.max_replicas is not None and (not 0 <= self.least <= self.max_replicas or self.max_replicas < 1):
            raise ValueError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")

    @property
    def least(self) -> int:
        """The autoscaler's minimum (1 unless --min-replicas says otherwise)."""
        return 1 if self.min_replicas is None else self.min_replicas

    @property
    def most(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas


class Board:
    """The replicas' latest reports, by replica id."""

    def __init__(self):
        self.reports: dict[str, tuple[float, dict]] = {}

    async def post(self, replica: str, report: dict) -> None:  # async: run on the one event loop, never racing
        self.reports[replica] = (time.monotonic(), report)

    async def fresh(self) -> list[dict]:
        now = time.monotonic()
        self.reports = {r: (t, rep) for r, (t, rep) in self.reports.items() if now - t < STALE_S}
        return [{"replica": r, **rep} for r, (_, rep) in sorted(self.reports.items())]


class Replica:
    """One engine and the single-process app around it. The constructor returns once the
    model is loaded, so Ray Serve routes nothing here before that."""

    def __init__(self, settings: ServerSettings, options: Any, board: DeploymentHandle):
        from qvl.engine import Engine
        from qvl.server.app import create_app

        self.app = create_app(settings, lambda: Engine.load(options))
        self.state = self.app.state.qvl
        self.state.start()
        self.state.models.wait_started()
        self.id = serve.get_replica_context().replica_id.unique_id
        self.board, self.closed = board, threading.Event()
        threading.Thread(target=self._report, name="qvl-report", daemon=True).start()

    def _report(self) -> None:
        while not self.closed.is_set():
            status, health = self.state.health()
            text = self.state.metrics.render(self.state.gauges(), self.state.cache_stats())
            try:
                self.board.post.remote(self.id, {"status": status, "health": health, "metrics": text})
            except Exception as exc:  # the board restarting: the next report goes through
                log.warning("replica %s: report failed: %s", self.id, exc)
            self.closed.wait(REPORT_EVERY_S)

    async def forward(self, request: dict):
        """Run one HTTP request through the app. Yields the head with the first body piece
        ({status, headers, body, more}), then body pieces (bytes). Cancelling this generator
        (the client went away) is the app's http.disconnect."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request["method"], "scheme": "http", "path": request["path"],
                 "raw_path": request["path"].encode(), "query_string": request["query"], "root_path": "",
                 "headers": request["headers"], "client": request["client"], "server": None, "state": {}}
        gone, sent_body = asyncio.Event(), False
        pieces: asyncio.Queue = asyncio.Queue()

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await pieces.put(message)

        app = asyncio.ensure_future(self.app(scope, receive, send))
        app.add_done_callback(lambda _: pieces.put_nowait(None))
        head = None
        try:
            while (message := await pieces.get()) is not None:
                if message["type"] == "http.response.start":
                    head = {"status": message["status"],
                            "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.id.encode())]}
                    continue
                if message["type"] != "http.response.body":
                    continue
                more = message.get("more_body", False)
                if head is not None:
                    yield {**head, "body": message.get("body", b""), "more": more}
                    head = None
                elif message.get("body"):
                    yield message["body"]
                if not more:
                    break
        finally:
            gone.set()
            if not app.done():
                await asyncio.wait({app}, timeout=5.0)
            if not app.done():
                app.cancel()
            elif not app.cancelled():
                app.exception()  # retrieved: the app already answered it (its 500) or the client left

    def __del__(self):
        """Ray Serve's graceful stop: refuse new work, let running requests finish within the grace period."""
        closed = getattr(self, "closed", None)
        if closed is None:
            return
        closed.set()
        self.state.begin_shutdown()
        deadline = time.monotonic() + self.state.settings.shutdown_grace_s
        while not self.state.drained() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.state.stop()


class Front:
    """The HTTP ingress: body limit, routing key, relay; /health and /metrics for the cluster."""

    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, settings: ServerSettings):
        self.replicas, self.board, self.settings = replicas, board, settings
        self.counts = Metrics()  # the answers the front gives itself (replicas count the ones they give)
        self.guard = BrowserGuard(None, settings.allowed_hosts, settings.allowed_origins)

    async def __call__(self, request: Request) -> Response:
        """The host/origin check and the API key come first, as in `qvl serve`: nothing is
        read from a client that may not call the API."""
        path = request.url.path
        try:
            refusal = self.guard.refusal(dict(request.headers.raw))
            if refusal is not None:
                raise refusal
            if path == "/health" and request.method in ("GET", "HEAD"):
                answer = await self.health()
            else:
                if path.startswith(KEYED):
                    self.check_key(request)
                if path == "/metrics" and request.method == "GET":
                    answer = await self.metrics()
                else:
                    return await self.relay(request)
        except Exception as exc:  # APIError, or a bug: a 500 in the API's shape
            answer = (exc if isinstance(exc, APIError) else internal(exc)).response(is_ollama(request))
        self.counts.count_request(path, answer.status_code)
        answer.raw_headers += SECURITY_HEADERS
        return answer

    def check_key(self, request: Request) -> None:
        from qvl.server.app import wrong_key

        keys = self.settings.api_keys
        if keys and matching_key(request.headers.get("authorization", ""), keys) is None:
            raise wrong_key()

    async def health(self) -> Response:
        reports = await self.board.fresh.remote()
        ready = [r for r in reports if r["status"] == 200]
        if not ready:
            return JSONResponse({"status": "loading", "replicas": 0}, status_code=503)
        first = ready[0]["health"]
        return JSONResponse({"status": "ok", "model": first["model"], "replicas": len(ready)})

    async def metrics(self) -> Response:
        reports = await self.board.fresh.remote()
        text = merge_texts([self.counts.render({}), *(r["metrics"] for r in reports)])
        text += f"# TYPE qvl_replicas gauge\nqvl_replicas {len(reports)}\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def relay(self, request: Request) -> Response:
        body = await read_body(request, self.settings.max_body_bytes)
        path = request.url.path
        client = request.client
        forwarded = {"method": request.method, "path": path, "query": request.url.query.encode(),
                     "headers": list(request.headers.raw), "body": body,
                     "client": [client.host, client.port] if client else None}
        key = (await asyncio.to_thread(routing_key, path, body) if len(body) > 65536 else routing_key(path, body)) or ""
        for attempt in range(2):  # a replica that died before answering: once more, elsewhere
            pieces = self.replicas.options(stream=True, session_id=key).forward.remote(forwarded)
            try:
                head = await pieces.__anext__()  # a whole answer, when it is not streamed
                break
            except REPLICA_GONE as exc:
                if attempt == 1:
                    raise replica_lost(exc) from None
            except BackPressureError:
                raise APIError(429, "the cluster is busy: every replica's queue is full; retry in 5 s",
                               code="queue_full", headers={"Retry-After": "5"}) from None
            except BaseException:  # the client left (this task cancelled): the replica's request stops too
                pieces.cancel()
                raise
        return Relay(head, pieces, path)


def replica_lost(exc: BaseException) -> APIError:
    log.warning("a replica stopped while answering: %s", exc)
    return APIError(503, "the replica answering this request stopped; send the request again",
                    code="replica_unavailable", headers={"Retry-After": "1"})


class Relay(Response):
    """A replica's answer passed on piece by piece; a replica lost mid-stream ends it with
    the route's own error event (the client sees a clean error, not a cut connection)."""

    def __init__(self, head: dict, pieces, path: str):
        super().__init__(status_code=head["status"])
        self.head, self.pieces, self.path = head, pieces, path
        self.raw_headers = [(bytes(k), bytes(v)) for k, v in head["headers"]]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.head["status"], "headers": self.raw_headers})
        more, events = self.head["more"], self.head["body"].count(b"event: ")
        await send({"type": "http.response.body", "body": self.head["body"], "more_body": more})
        try:
            while more:
                try:
                    piece = await self.pieces.__anext__()
                except StopAsyncIteration:
                    more = False
                    piece = b""
                except Exception as exc:  # the replica lost, or a bug: the route's error event ends the stream
                    more = False
                    error = replica_lost(exc) if isinstance(exc, REPLICA_GONE) else internal(exc)
                    piece = stream_failure(self.path, error, events)
                events += piece.count(b"event: ")
                await send({"type": "http.response.body", "body": piece, "more_body": more})
        finally:
            self.pieces.cancel()  # the client left (or the answer ended): the replica's request stops


def stream_failure(path: str, error: APIError, events: int) -> bytes:
    """The end of a stream whose headers went out, in the route's wire format (nothing for
    files: the page and its scripts just end short)."""
    if not path.startswith(KEYED):
        return b""
    if path.startswith("/api/"):
        return (json.dumps({"error": error.message}) + "\n").encode()
    if path == "/v1/responses":
        body = {"type": "error", "sequence_number": events, "code": error.code, "message": error.message, "param": None}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


def build(settings: ServerSettings, options: Any, scale: Scale):
    """The Ray Serve application: Front -> Replica (routed by content) + Board."""
    quiet = {"enable_access_log": False}
    board = serve.deployment(Board, name="Board", num_replicas=1, ray_actor_options={"num_cpus": 0},
                             logging_config=quiet)
    rows = options.max_batch
    replica_options: dict = {
        "name": "Replica", "ray_actor_options": {"num_cpus": scale.cpus},
        "max_ongoing_requests": rows + settings.queue_size,  # what one `qvl serve` accepts before its 429
        "max_queued_requests": max(1, settings.queue_size * scale.most),
        "graceful_shutdown_timeout_s": settings.shutdown_grace_s + 5,
        "health_check_period_s": 5.0, "logging_config": quiet,  # the front logs each request
    }
    if ROUTERS[scale.router]:
        replica_options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTERS[scale.router],
            request_router_kwargs={"rows": rows} if scale.router == "content" else {})
    if scale.max_replicas is not None:
        replica_options["autoscaling_config"] = {
            "min_replicas": scale.least, "initial_replicas": max(1, scale.least), "max_replicas": scale.max_replicas,
            "target_ongoing_requests": rows,  # a replica with every row busy and a queue wants company
            "metrics_interval_s": 2.0, "look_back_period_s": 10.0, "upscale_delay_s": 5.0,
            "downscale_delay_s": 120.0}
    else:
        replica_options["num_replicas"] = scale.replicas
    replica = serve.deployment(Replica, **replica_options)
    front = serve.deployment(Front, name="Front", num_replicas=1, max_ongoing_requests=1000,
                             graceful_shutdown_timeout_s=settings.shutdown_grace_s + 5,
                             ray_actor_options={"num_cpus": 0})
    posts = board.bind()
    return front.bind(replica.bind(settings, options, posts), posts, settings)


def run(settings: ServerSettings, options: Any, scale: Scale, *, host: str, port: int, address: str | None) -> int:
    """Deploy on the Ray cluster at `address` (None: $RAY_ADDRESS, else a local one started
    here), serve until SIGTERM/SIGINT, then take the application down (and the local cluster)."""
    import os
    import signal

    import ray

    local = address is None and not os.environ.get("RAY_ADDRESS")  # a cluster of our own, ended with us
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": host, "port": port, "keep_alive_timeout_s": settings.connections.keep_alive_s,
                                  "request_timeout_s": settings.time_limit_s + 30})  # never a request waiting forever
        log.info("deploying %s on Ray: waiting for the replicas to load the model", APP)
        serve.run(build(settings, options, scale), name=APP, route_prefix="/", blocking=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        log.info("qvl serve --ray: listening on http://%s:%d (Ray Serve)", host, port)
        stop.wait()
        log.info("stopping: in-flight requests may finish within %g s", settings.shutdown_grace_s)
        return 0
    finally:
        try:
            serve.delete(APP)
            if local:
                serve.shutdown()
        finally:
            ray.shutdown()
