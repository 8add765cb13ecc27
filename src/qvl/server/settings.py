"""What an operator can change: limits, image sources, the API keys. No heavy imports, so
`qvl serve --help` can show these defaults without loading torch."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

MB = 1024 * 1024
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
BYTE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class ImagePolicy:
    max_bytes: int = 20 * MB  # per image, after base64 decoding / download
    max_pixels: int = 40_000_000  # declared width x height, checked before decoding
    url_hosts: tuple[str, ...] = ()  # "example.com", "*.example.com" or "*"; empty = no http(s)
    url_timeout_s: float = 10.0
    local_dir: Path | None = None  # file: URLs and paths allowed only under this folder
    max_video_bytes: int = 200 * MB  # per video fetched or read from local_dir (a data: URI is bounded by the body)


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send its request and to take its answer, and how many
    connections stay open."""

    max_connections: int = 64  # past it, the longest-idle connection without a request is closed,
    # else the slowest one still sending its body
    header_timeout_s: float = 10.0  # a request head must be complete this long after the connection
    # opened (or the previous answer ended)
    body_timeout_s: float = 60.0  # the body must be complete this long after its head
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    write_timeout_s: float = 30.0  # a client that takes none of its answer for this long is cut off

    def __post_init__(self):
        if self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_s, self.write_timeout_s) <= 0:
            raise ValueError("the header, body, write and keep-alive timeouts must be > 0")


def keep_alive_s(value: object) -> float | None:
    """Ollama's keep_alive as seconds; None: kept loaded forever. A number is seconds, a string
    a Go duration ("5m", "1h30m", "90s", "0"; a bare number counts as seconds); a negative one
    means forever. Anything else is a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("keep_alive must be a duration such as \"5m\" or a number of seconds")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        pieces = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", body)
        if re.fullmatch(r"\d+(?:\.\d*)?", body):
            value = sign * float(body)
        elif pieces and "".join(n + u for n, u in pieces) == body:
            value = sign * sum(float(n) * DURATION_UNITS[u] for n, u in pieces)
        else:
            raise ValueError(f"keep_alive '{value}' is not a duration (such as \"5m\", \"1h30m\", \"0\", \"-1\")")
    if not math.isfinite(value):
        raise ValueError("keep_alive must be finite (a negative value keeps the model loaded)")
    return None if value < 0 else float(value)


def byte_size(text: str) -> int:
    """'12G', '512M', '1.5T', '800000000' -> bytes (binary units; a trailing B or iB is allowed)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"'{text}' is not a size: give bytes, or a number with K, M, G or T (12G)")
    return int(float(match.group(1)) * BYTE_UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class ModelLimits:
    """How long models stay loaded and how many may be at once (a server of several models)."""

    keep_alive_s: float | None = None  # idle this long after its last request, a model is unloaded; None: never
    max_loaded: int | None = None  # models loaded at once; None: no limit
    max_memory_bytes: int | None = None  # what the loaded models may hold together (weights, KV, caches)

    def __post_init__(self):
        if self.keep_alive_s is not None and self.keep_alive_s < 0:
            raise ValueError("--keep-alive must be >= 0 (or negative on the command line: forever)")
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError("--max-loaded must be >= 1")
        if self.max_memory_bytes is not None and self.max_memory_bytes < 1:
            raise ValueError("--max-memory must be > 0")


@dataclass(frozen=True)
class ServerSettings:
    queue_size: int = 8  # requests waiting behind the one being generated
    max_body_bytes: int = 20 * MB
    time_limit_s: float = 300.0  # per request, from acceptance to the last token
    shutdown_grace_s: float = 30.0  # on SIGTERM, in-flight work may finish within this
    api_keys: tuple[str, ...] = ()  # any of them opens the API; each is a cache namespace of its own
    hide_cache_stats: bool = False  # answers do not say what came from the caches
    parse_slots: int = 2  # requests decoding images and videos and tokenizing at once (bounds memory), in each
    # of two lanes: requests with images or videos, and requests without
    parse_timeout_s: float = 60.0  # preparing one request (decoding, tokenizing); a slot is awaited as long
    warm_up: bool = True  # run Engine.warm_up in the worker once loaded, before the first request
    images: ImagePolicy = field(default_factory=ImagePolicy)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    models: ModelLimits = field(default_factory=ModelLimits)
    # Host header values answered ("name", "*.name", "*"; ports ignored); None: any. The CLI
    # sets the loopback names for a loopback bind, plus --allowed-hosts.
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()  # hosts of other browser origins that may call the API

    def __post_init__(self):
        checks = [(self.queue_size >= 0, "the queue size must be >= 0"),
                  (self.max_body_bytes > 0, "the body limit must be > 0"),
                  (self.time_limit_s > 0, "the request time limit must be > 0"),
                  (self.shutdown_grace_s >= 0, "the shutdown grace period must be >= 0"),
                  (self.parse_slots >= 1, "parse_slots must be >= 1"),
                  (self.parse_timeout_s > 0, "the parse timeout must be > 0"),
                  (self.images.max_pixels > 0 and self.images.max_bytes > 0, "image limits must be > 0")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
