"""A local stand-in for the Hugging Face hub's file API, serving one repository from a folder:
the model info and tree listings, HEAD and GET (with ranges) of /resolve/ with the headers
huggingface_hub reads (X-Repo-Commit, ETag, X-Linked-Etag/-Size for LFS files). A test can
make it drop a file's connection after some bytes, stall there until released, or send a
corrupted copy; it records every request."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Served:
    data: bytes
    lfs: bool

    @property
    def etag(self) -> str:  # what the hub names the blob: sha256 for LFS files, the git blob hash otherwise
        if self.lfs:
            return hashlib.sha256(self.data).hexdigest()
        return hashlib.sha1(f"blob {len(self.data)}\0".encode() + self.data).hexdigest()


@dataclass
class HubMirror:
    repo: str
    folder: Path
    extra: dict[str, bytes] = field(default_factory=dict)  # more files (a README the pull must skip)
    cut: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before its next GET's connection drops
    stall: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before its GETs wait for `release`
    corrupt: set[str] = field(default_factory=set)  # files served with one byte changed
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.files = {p.name: Served(p.read_bytes(), p.suffix == ".safetensors")
                      for p in sorted(self.folder.iterdir()) if p.is_file()}
        self.files.update({name: Served(data, False) for name, data in self.extra.items()})

    def __enter__(self) -> HubMirror:
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                mirror.answer(self, head=True)

            def do_GET(self):
                mirror.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str | None]:
        """The Range header of each GET of file `name`."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith(f"/resolve/{COMMIT}/{name}")]

    # -- answers -------------------------------------------------------------------------------

    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        api, resolve = f"/api/models/{self.repo}/", f"/{self.repo}/resolve/"
        if path.startswith(api + "revision/"):
            return self.json(h, {"id": self.repo, "sha": COMMIT, "private": False,
                                 "siblings": [{"rfilename": n} for n in self.files]})
        if path.startswith(api + "tree/"):
            return self.json(h, [{"type": "file", "path": n, "size": len(f.data), "oid": f.etag if not f.lfs else
                                  hashlib.sha1(n.encode()).hexdigest(),
                                  **({"lfs": {"oid": f.etag, "size": len(f.data), "pointerSize": 134}} if f.lfs else {})}
                                 for n, f in self.files.items()])
        if path.startswith(resolve):
            name = path[len(resolve):].partition("/")[2]
            if name in self.files:
                return self.file(h, name, head)
            return self.missing(h, "EntryNotFound")
        return self.missing(h, "RepoNotFound")

    def json(self, h: BaseHTTPRequestHandler, body) -> None:
        data = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def missing(self, h: BaseHTTPRequestHandler, code: str) -> None:
        h.send_response(404)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def file(self, h: BaseHTTPRequestHandler, name: str, head: bool) -> None:
        f = self.files[name]
        data = bytearray(f.data)
        if name in self.corrupt:
            data[len(data) // 2] ^= 0xFF
        start = int(h.headers["Range"].removeprefix("bytes=").split("-")[0]) if h.headers.get("Range") else 0
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{f.etag}"')
        if f.lfs:
            h.send_header("X-Linked-Etag", f'"{f.etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(data) - start))
        h.end_headers()
        if head:
            return
        body = bytes(data[start:])
        if name in self.cut:
            h.wfile.write(body[: self.cut.pop(name) - start])
            h.wfile.flush()
            h.close_connection = True
            return
        if name in self.stall and start < self.stall[name]:
            h.wfile.write(body[: self.stall[name] - start])
            h.wfile.flush()
            self.release.wait(60)
            h.close_connection = True
            return
        h.wfile.write(body)
