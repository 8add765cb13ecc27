"""Helpers for the server tests (no tests here): images, a live `qvl serve` subprocess."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import httpx
from PIL import Image


def png_bytes(width: int = 64, height: int = 48, color=(200, 30, 30), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, fmt)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height but carries no pixel data: decoding it would fail,
    so a refusal naming the size proves the size was checked before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(text: str, *images: bytes) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(im)}} for im in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`qvl serve` on a free loopback port, as a subprocess."""

    def __init__(self, checkpoint, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "qvl.cli", "serve", "--model", str(checkpoint), "--host", "127.0.0.1",
               "--port", str(self.port), "--weights", "fp32", "--dtype", "fp32", "--threads", "1",
               "--log-level", "warning", *args]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout_s: float = 90) -> LiveServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qvl serve exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"qvl serve was not ready within {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@contextlib.contextmanager
def live_server(checkpoint, *args: str):
    server = LiveServer(checkpoint, *args)
    try:
        yield server.wait_ready()
    finally:
        server.stop()
