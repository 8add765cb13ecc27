"""`image_url` and `video_url` values -> bytes for the engine, refused early when unusable.

data: URIs (base64) always work. http(s) URLs only for hosts the operator allowed, only to
public addresses (the address checked is the address connected to: no DNS rebinding), no
redirects, with a byte cap and a timeout. Local paths only inside one allowed folder.
Every image's header is read before any pixel is decoded: format and pixel count checked.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import ipaddress
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from qvl.processing.image import ImageError
from qvl.processing.pdf import is_pdf
from qvl.server.settings import MB, ImagePolicy

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow decoders we expose to the network


def load_image_bytes(url: str, policy: ImagePolicy) -> bytes:
    """The bytes of one image_url, with its header checked (a PDF is checked when its pages
    are drawn); raises ImageError."""
    data = load_bytes(url, policy, "image", policy.max_bytes)
    if not is_pdf(data):
        check_header(data, policy.max_pixels)
    return data


def load_video_bytes(url: str, policy: ImagePolicy) -> bytes:
    """The bytes of one video_url under the image rules (data: URIs; allowed hosts; the allowed
    folder), up to policy.max_video_bytes; the engine checks the clip itself."""
    return load_bytes(url, policy, "video", policy.max_video_bytes)


def load_bytes(url: str, policy: ImagePolicy, kind: str, max_bytes: int) -> bytes:
    scheme = url.partition(":")[0].lower()  # schemes are case-insensitive (RFC 3986)
    if scheme == "data":
        return decode_data_uri(url, max_bytes, kind)
    if scheme in ("http", "https") and url[len(scheme) + 1:].startswith("//"):
        return fetch(url, policy, kind, max_bytes)
    if policy.local_dir is not None:
        return read_local(url, policy, kind, max_bytes)
    raise ImageError(f"{kind}_url must be a data: URI with base64 data (http(s) URLs and local paths "
                     "are off on this server)")


def decode_data_uri(url: str, max_bytes: int, kind: str = "image") -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma or "base64" not in [p.strip().lower() for p in header.split(";")[1:]]:
        example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
        raise ImageError(f"data: URI must be base64-encoded: {example}")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ImageError(f"{kind} is larger than the limit of {max_bytes // MB} MB")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 in data: URI ({e})") from None


def check_header(data: bytes, max_pixels: int) -> None:
    """Identify the format and size from the header only: nothing is decoded here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as img:
                width, height = img.size
        except Image.UnidentifiedImageError:
            raise ImageError(f"not a supported image: send {', '.join(FORMATS)}") from None
        except Image.DecompressionBombError as e:
            raise ImageError(f"image refused as a decompression bomb: {e}") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ImageError(f"could not read the image header: {e}") from None
    if width * height > max_pixels:
        raise ImageError(f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")


# -- http(s) -----------------------------------------------------------------------------------


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    return any(p == "*" or host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in patterns)


NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix: the IPv4 address is the last 32 bits
LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # local-use NAT64 (RFC 8215): never public
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and reaches (mapped, NAT64, 6to4, IPv4-compatible)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64 or ip in IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """False for private, loopback, link-local, multicast, reserved and unspecified addresses,
    also when written as an IPv6 address that embeds one (NAT64, 6to4, mapped, compatible)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in LOCAL_NAT64:
            return False
        if (v4 := embedded_ipv4(ip)) is not None:
            return is_public(v4)
    return ip.is_global and not ip.is_multicast


def public_address(host: str, port: int, kind: str) -> str:
    """Resolve `host`; every address must be public. Returns the one to connect to."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ImageError(f"cannot resolve {kind} host '{host}': {e}") from None
    addresses = sorted({info[4][0] for info in infos})
    for address in addresses:
        if not is_public(ipaddress.ip_address(address.split("%")[0])):
            raise ImageError(f"{kind} host '{host}' resolves to a non-public address; refused")
    if not addresses:
        raise ImageError(f"cannot resolve {kind} host '{host}'")
    return addresses[0]


def fetch(url: str, policy: ImagePolicy, kind: str, max_bytes: int) -> bytes:
    if not policy.url_hosts:
        raise ImageError(f"http(s) {kind} URLs are off on this server: send the {kind} as a base64 data: URI")
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.username or parts.password or not host:
        raise ImageError(f"{kind} URL must name a host and carry no credentials")
    if not host_allowed(host, policy.url_hosts):
        raise ImageError(f"{kind} host '{host}' is not in this server's allowed hosts")
    https = parts.scheme == "https"
    try:
        port = parts.port or (443 if https else 80)
    except ValueError:
        raise ImageError(f"{kind} URL has an invalid port") from None
    deadline = time.monotonic() + policy.url_timeout_s  # one deadline: connect, headers, body
    address = public_address(host, port, kind)
    watchdog = Watchdog(deadline)

    def connect(_address, timeout, source=None) -> socket.socket:
        # Connect to the address we checked, not to whatever a second DNS lookup returns
        # (TLS still verifies the certificate against `host`).
        sock = socket.create_connection((address, port), max(0.001, deadline - time.monotonic()), source)
        watchdog.watch(sock)
        return sock

    conn = (http.client.HTTPSConnection if https else http.client.HTTPConnection)(
        host, port, timeout=policy.url_timeout_s)
    conn._create_connection = connect
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"User-Agent": "qvl", "Accept": f"{kind}/*"})
        response = conn.getresponse()
        if response.status != 200:
            hint = " (redirects are not followed)" if 300 <= response.status < 400 else ""
            raise ImageError(f"fetching the {kind} from '{host}' failed: HTTP {response.status}{hint}")
        data = read_capped(response, max_bytes, deadline, kind)
        if watchdog.fired:  # the connection was cut: what arrived is not the whole image
            raise TimeoutError
        return data
    except (OSError, http.client.HTTPException) as e:
        if watchdog.fired or time.monotonic() >= deadline or isinstance(e, TimeoutError):
            raise ImageError(f"fetching the {kind} from '{host}' timed out after {policy.url_timeout_s:g} s "
                             "(--image-url-timeout)") from None
        raise ImageError(f"fetching the {kind} from '{host}' failed: {e or type(e).__name__}") from None
    finally:
        watchdog.stop()
        conn.close()


class Watchdog:
    """Cuts a connection at its deadline, whatever it is waiting for (the connection, the TLS
    handshake, a header sent one byte at a time): per-read socket timeouts cannot, because
    every byte restarts them."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.lock = threading.Lock()
        self.guard: socket.socket | None = None
        self.timer: threading.Timer | None = None
        self.fired = False

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            # A descriptor of our own: closing the connection's cannot hand its number to
            # another socket that the timer would then cut.
            self.guard = sock.dup()
            self.timer = threading.Timer(max(0.0, self.deadline - time.monotonic()), self._fire)
            self.timer.daemon = True
            self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.guard is not None:
                self.fired = True
                with contextlib.suppress(OSError):
                    self.guard.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
            if self.guard is not None:
                self.guard.close()
                self.guard = None


def read_capped(response: http.client.HTTPResponse, max_bytes: int, deadline: float, kind: str) -> bytes:
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ImageError(f"{kind} is larger than the limit of {max_bytes // MB} MB")
    chunks, size = [], 0
    while chunk := response.read1(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            raise ImageError(f"{kind} is larger than the limit of {max_bytes // MB} MB")
        if time.monotonic() > deadline:
            raise TimeoutError
        chunks.append(chunk)
    return b"".join(chunks)


# -- local files -------------------------------------------------------------------------------


def read_local(url: str, policy: ImagePolicy, kind: str = "image", max_bytes: int | None = None) -> bytes:
    max_bytes = policy.max_bytes if max_bytes is None else max_bytes
    if url[:5].lower() == "file:":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError("file: URLs must name a local path")
        url = unquote(parts.path)
    root = os.path.realpath(policy.local_dir)
    path = os.path.realpath(os.path.join(root, url))  # an absolute `url` replaces root here
    if os.path.commonpath([root, path]) != root:
        raise ImageError(f"{kind} path is outside the folder this server allows")
    if not os.path.isfile(path):
        raise ImageError(f"{kind} file not found: {url}")
    if os.path.getsize(path) > max_bytes:
        raise ImageError(f"{kind} is larger than the limit of {max_bytes // MB} MB")
    return Path(path).read_bytes()
