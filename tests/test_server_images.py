"""Image sources of the server: data: URIs, SSRF-safe http(s) fetching, the allowed folder."""

from __future__ import annotations

import base64
import contextlib
import http.server
import ipaddress
import os
import threading
import time

import pytest

from qvl.processing.image import ImageError
from qvl.server import images
from qvl.server.images import check_header, decode_data_uri, host_allowed, load_image_bytes, read_local
from qvl.server.settings import ImagePolicy
from tests.test_server_support import data_uri, png_bytes, png_header_only

PNG = png_bytes(32, 32)


def test_data_uris():
    assert decode_data_uri(data_uri(PNG), 10**6) == PNG
    wrapped = "data:image/png;base64," + base64.encodebytes(PNG).decode()
    assert decode_data_uri(wrapped, 10**6) == PNG
    assert decode_data_uri("data:;base64," + base64.b64encode(PNG).decode(), 10**6) == PNG
    for bad in ("data:image/png,abc", "data:image/png;base64", "data:image/png;base64,@@@@", "data:image/png;base64,abc"):
        with pytest.raises(ImageError):
            decode_data_uri(bad, 10**6)
    with pytest.raises(ImageError, match="larger than"):
        decode_data_uri(data_uri(bytes(3000)), 1000)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_supported_formats_pass_the_header_check(fmt):
    check_header(png_bytes(16, 16, fmt=fmt), 10**6)


def test_header_check_refuses_before_decoding():
    with pytest.raises(ImageError, match="exceeds the limit"):
        check_header(png_header_only(5000, 5000), 10**6)  # no pixel data at all: never decoded
    for data in (b"GIF89a", png_bytes(fmt="PPM"), png_bytes(fmt="ICO"), b"%!PS-Adobe-3.0 EPSF-3.0\n"):
        with pytest.raises(ImageError):
            check_header(data, 10**6)


@pytest.mark.parametrize("address,public", [
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("0.0.0.0", False), ("100.64.0.1", False), ("224.0.0.1", False),
    ("255.255.255.255", False), ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("ff02::1", False),
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True),
    # IPv6 forms that embed an IPv4 address reach it (NAT64, 6to4, IPv4-compatible): judged by it
    ("64:ff9b::7f00:1", False), ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::a00:1", False),
    ("2002:a9fe:a9fe::", False), ("2002:7f00:1::1", False), ("::a9fe:a9fe", False), ("::7f00:1", False),
    ("64:ff9b:1::a9fe:a9fe", False), ("64:ff9b::808:808", True), ("2002:808:808::1", True),
])
def test_public_addresses(address, public):
    assert images.is_public(ipaddress.ip_address(address)) is public


def test_host_allowlist():
    assert host_allowed("img.example.com", ("img.example.com",))
    assert host_allowed("a.example.com", ("*.example.com",))
    assert not host_allowed("example.com.evil.org", ("*.example.com",))
    assert not host_allowed("evil.org", ("img.example.com",))
    assert host_allowed("anything.org", ("*",))
    assert not host_allowed("anything.org", ())


@pytest.mark.parametrize("url,message", [
    ("http://127.0.0.1:9/x.png", "non-public"),
    ("http://localhost:9/x.png", "non-public"),
    ("http://[::1]:9/x.png", "non-public"),
    ("http://169.254.169.254/latest/meta-data", "non-public"),
    ("http://user:pw@example.com/x.png", "credentials"),
    ("http://example.com:99999/x.png", "invalid port"),
])
def test_fetch_refuses_private_addresses_and_odd_urls(url, message):
    with pytest.raises(ImageError, match=message):
        load_image_bytes(url, ImagePolicy(url_hosts=("*",)))


def test_fetch_needs_the_flag_and_an_allowed_host():
    with pytest.raises(ImageError, match="off on this server"):
        load_image_bytes("https://example.com/x.png", ImagePolicy())
    with pytest.raises(ImageError, match="not in this server's allowed hosts"):
        load_image_bytes("https://evil.org/x.png", ImagePolicy(url_hosts=("example.com",)))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
            return
        if self.path == "/slow":
            time.sleep(1.5)
        body = bytes(5000) if self.path == "/big" else PNG
        self.send_response(200)
        if self.path != "/big":  # /big: no length declared, the reader must count
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client may have given up already
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_host(monkeypatch):
    """A local HTTP server standing in for a public host (the address check is lifted)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(images, "is_public", lambda ip: True)
    yield f"http://localhost:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetch_from_an_allowed_host(image_host):
    policy = ImagePolicy(url_hosts=("localhost",), max_bytes=4000, url_timeout_s=0.5)
    assert load_image_bytes(f"{image_host}/cat.png", policy) == PNG
    with pytest.raises(ImageError, match="redirects are not followed"):
        load_image_bytes(f"{image_host}/redirect", policy)
    with pytest.raises(ImageError, match="larger than"):
        load_image_bytes(f"{image_host}/big", policy)
    with pytest.raises(ImageError, match="timed out"):
        load_image_bytes(f"{image_host}/slow", policy)


def test_local_folder(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    os.symlink(outside / "secret.png", allowed / "link.png")
    policy = ImagePolicy(local_dir=allowed)
    assert read_local("cat.png", policy) == PNG
    assert read_local(str(allowed / "cat.png"), policy) == PNG
    assert load_image_bytes(f"file://{allowed / 'cat.png'}", policy) == PNG
    for escape in ("../outside/secret.png", str(outside / "secret.png"), "link.png", "file:///etc/passwd"):
        with pytest.raises(ImageError, match="outside the folder"):
            read_local(escape, policy)
    with pytest.raises(ImageError, match="not found"):
        read_local("missing.png", policy)


def test_schemes_are_case_insensitive():
    encoded = base64.b64encode(PNG).decode()
    assert load_image_bytes(f"DATA:image/png;BASE64,{encoded}", ImagePolicy()) == PNG
    assert load_image_bytes(f"Data:image/png;base64,{encoded}", ImagePolicy()) == PNG
    with pytest.raises(ImageError, match="http\\(s\\) image URLs are off"):  # seen as a URL, not as a path
        load_image_bytes("HTTP://example.com/cat.png", ImagePolicy())
    with pytest.raises(ImageError, match="not in this server's allowed hosts"):
        load_image_bytes("HttpS://evil.org/cat.png", ImagePolicy(url_hosts=("example.com",)))


@pytest.fixture
def dribbling_host(monkeypatch):
    """A host that answers one header byte every 0.2 s, for up to 10 s."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 50:
                    if stop.wait(0.2):
                        return
                    conn.sendall(bytes([byte]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setattr(images, "is_public", lambda ip: True)
    yield f"http://localhost:{listener.getsockname()[1]}"
    stop.set()
    listener.close()
    thread.join(5)


def test_one_deadline_covers_headers_sent_slowly(dribbling_host):
    """Each byte arrives well within the per-read timeout; the fetch still ends at its deadline."""
    policy = ImagePolicy(url_hosts=("localhost",), url_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ImageError, match="timed out after 1 s"):
        load_image_bytes(f"{dribbling_host}/cat.png", policy)
    assert time.monotonic() - started < 2.0
