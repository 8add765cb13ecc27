"""What an operator can change: limits, image sources, the API keys. No heavy imports, so
`qvl serve --help` can show these defaults without loading torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MB = 1024 * 1024


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
