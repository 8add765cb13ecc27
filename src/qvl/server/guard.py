"""What a browser may do with qvl: the Host and Origin checks and the headers every answer
carries. An ASGI middleware, so it runs before any route.

- **Host.** A page on another site can make the browser talk to a loopback server, and with
  DNS rebinding (its own name resolving to 127.0.0.1) read the answers too; the request then
  names the attacker's host. Only the allowed names are answered (settings.allowed_hosts).
- **Origin.** A browser names the page that sent a request; a request from another origin
  (a form or fetch from another site, which needs no rebinding) is refused unless its host
  is one the operator allowed. Clients outside a browser send no Origin.
- **Headers.** The page may only load its own files and may not be framed.

And who a caller is: the API key it sends (one of `--api-key`), which is also its cache
namespace: callers of different keys share no cached work (cache_salt).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

from qvl.server.errors import APIError

SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; media-src blob:; "
                                 b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def split_host(value: str) -> tuple[str, str]:
    """'Example.com:8000' -> ('example.com', '8000'); '[::1]:80' -> ('::1', '80')."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest.removeprefix(":")
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return host.rstrip("."), port


def host_matches(host: str, patterns: tuple[str, ...]) -> bool:
    """`host` is one of `patterns` ("name", "*.name", "*"); any loopback address matches a
    loopback address in the patterns."""
    if any(p == "*" or host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in patterns):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback and any(_is_loopback_address(p) for p in patterns)


def _is_loopback_address(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


class BrowserGuard:
    def __init__(self, app, allowed_hosts: tuple[str, ...] | None, allowed_origins: tuple[str, ...]):
        self.app, self.allowed_hosts, self.allowed_origins = app, allowed_hosts, allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        refusal = self.refusal(dict(scope["headers"]))
        if refusal is not None:
            return await refusal.response()(scope, receive, send_with_headers)
        await self.app(scope, receive, send_with_headers)

    def refusal(self, headers: dict[bytes, bytes]) -> APIError | None:
        host_header = headers.get(b"host", b"").decode("latin-1")
        host, _ = split_host(host_header)
        if self.allowed_hosts is not None and host_header and not host_matches(host, self.allowed_hosts):
            return APIError(421, f"this server does not answer for the host '{host}'; start it with "
                                 f"--allowed-hosts {host} if that name is meant to reach it", code="invalid_host")
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_allowed(origin.decode("latin-1"), host_header):
            return APIError(403, "requests from other web pages are refused; start the server with "
                                 "--allowed-hosts NAME to let the page at NAME call it", code="invalid_origin")
        return None

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        """The page's own origin (same host and port as the request names), or an allowed host."""
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file: pages) and anything odd
        if split_host(parts.netloc) == split_host(host_header):
            return True
        return host_matches(split_host(parts.netloc)[0], self.allowed_origins)


def matching_key(authorization: str, keys: tuple[str, ...]) -> str | None:
    """The one of `keys` an Authorization header 'Bearer <key>' carries (compared in constant
    time with each), or None."""
    scheme, _, token = authorization.partition(" ")
    found = None
    for key in keys:
        if hmac.compare_digest(token.strip().encode(), key.encode()):
            found = key
    return found if scheme.lower() == "bearer" else None


def cache_salt(key: str | None, salt: str | None) -> str:
    """The engine's cache salt for a request: a digest of the caller's API key (each key is a
    namespace of its own) and the request's own `cache_salt` field; "" for neither."""
    if not key and not salt:
        return ""
    return f"{hashlib.sha256(key.encode()).hexdigest() if key else ''}\0{salt or ''}"
