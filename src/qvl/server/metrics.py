"""Counters and histograms in the Prometheus text format (no client library needed).
Updated from the event loop and the worker thread, so every update takes the lock."""

from __future__ import annotations

import threading
from collections import Counter

from qvl.stream import Done

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)  # decoded tokens per second
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions")  # bounded label set


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.cancelled: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()  # prompt, completion, image
        self.cache_hits = 0
        self.queue_wait = Histogram(SECONDS_BUCKETS)
        self.ttft = Histogram(SECONDS_BUCKETS)  # from the start of generation (queue wait excluded)
        self.tps = Histogram(TPS_BUCKETS)

    def count_request(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[(path if path in ROUTES else "other", status)] += 1

    def count_cancel(self, reason: str) -> None:
        with self.lock:
            self.cancelled[reason] += 1

    def observe_wait(self, seconds: float) -> None:
        with self.lock:
            self.queue_wait.observe(seconds)

    def record(self, done: Done, cached: bool = False) -> None:
        """One finished generation (or an answer served from the engine's cache); the prompt
        counts once per request, with its first answer (the n answers of one request share it)."""
        with self.lock:
            first = done.index == 0
            self.tokens.update(prompt=done.usage.prompt_tokens if first else 0,
                               completion=done.usage.completion_tokens, image=done.usage.image_tokens if first else 0)
            if cached:
                self.cache_hits += 1
                return
            self.ttft.observe(done.timings.ttft_ms / 1000)
            if done.timings.decode_ms_per_token > 0:
                self.tps.observe(1000 / done.timings.decode_ms_per_token)

    def render(self, gauges: dict[str, float], caches: dict | None = None) -> str:
        """gauges: current values by metric name (queue depth, busy, ready...);
        caches: the engine's CacheStats by cache name (vision, prefix, answer)."""
        with self.lock:
            lines = ["# TYPE qvl_requests_total counter"]
            lines += [f'qvl_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())]
            for name, value in gauges.items():
                lines += [f"# TYPE {name} gauge", f"{name} {value:g}"]
            lines += ["# TYPE qvl_cancelled_total counter"]
            lines += [f'qvl_cancelled_total{{reason="{r}"}} {n}' for r, n in sorted(self.cancelled.items())]
            for kind in ("prompt", "completion", "image"):
                lines += [f"# TYPE qvl_{kind}_tokens_total counter", f"qvl_{kind}_tokens_total {self.tokens[kind]}"]
            lines += ["# TYPE qvl_answer_cache_hits_total counter", f"qvl_answer_cache_hits_total {self.cache_hits}"]
            for field, kind in (("hits", "counter"), ("misses", "counter"), ("evictions", "counter"),
                                ("bytes", "gauge"), ("entries", "gauge")):
                name = f"qvl_cache_{field}" + ("_total" if kind == "counter" else "")
                lines += [f"# TYPE {name} {kind}"]
                lines += [f'{name}{{cache="{c}"}} {getattr(st, field)}' for c, st in (caches or {}).items()]
            lines += ["# TYPE qvl_queue_wait_seconds histogram"]
            lines += self.queue_wait.lines("qvl_queue_wait_seconds")
            lines += ["# TYPE qvl_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("qvl_time_to_first_token_seconds")
            lines += ["# TYPE qvl_decode_tokens_per_second histogram"]
            lines += self.tps.lines("qvl_decode_tokens_per_second")
        return "\n".join(lines) + "\n"


class StatusCounter:
    """ASGI middleware: counts every HTTP response by route and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_request(scope["path"], message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.metrics.count_request(scope["path"], 500)
            raise


def merge_texts(texts: list[str]) -> str:
    """Several render() outputs as one: the samples of each series summed (counters and
    histograms add up; gauges become cluster totals: queue depth, running rows, bytes).
    Each family's samples stay under its TYPE line, in first-seen order."""
    families: dict[str, dict[str, float]] = {}  # TYPE line -> series -> value
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                family = families.setdefault(line, {})
            elif line and not line.startswith("#") and family is not None:
                series, _, value = line.rpartition(" ")
                family[series] = family.get(series, 0.0) + float(value)

    def number(v: float) -> str:
        return str(int(v)) if v.is_integer() else f"{v:.9g}"

    lines = []
    for type_line, samples in families.items():
        lines += [type_line, *(f"{series} {number(value)}" for series, value in samples.items())]
    return "\n".join(lines) + ("\n" if lines else "")
