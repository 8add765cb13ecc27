"""The process in which pdfium opens and draws PDFs for qvl.processing.pdf. pdfium is not
thread-safe, and a hostile PDF can make it take gigabytes and minutes (forms that each draw
the next twice, 22 deep; a content stream that inflates to hundreds of MB) or kill it; here
that costs at most this process, which runs under an address-space limit while its caller
keeps the clock and kills it at the deadline. Imports only the standard library and pypdfium2.

Messages, both ways: 4 bytes little-endian, the length of a JSON header; the header; then
header["size"] bytes of payload. No pickle: the caller never runs what this process sends.
Commands, one reply each (a document and a page stay open between them):
  {"op": "open", "path": str | None} + the PDF's bytes when path is None -> {"pages": n}
  {"op": "load", "page": n (from 1)} -> {"width", "height"}: points, rotation applied
  {"op": "draw", "scale": s} -> {"width", "height", "stride"} + the loaded page's BGR rows
  {"op": "close"} -> {}
pdfium's refusal of a document is the reply {"error": reason}; anything worse ends the process.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys

MB = 1024 * 1024


def send(stream, header: dict, payload: bytes | memoryview = b"") -> None:
    head = json.dumps({**header, "size": len(payload)}).encode()
    stream.write(struct.pack("<I", len(head)) + head)
    stream.write(payload)
    stream.flush()


def receive(stream) -> tuple[dict, bytes] | None:
    """The next message, or None when the other side has gone (the stream ended)."""
    prefix = stream.read(4)
    if len(prefix) < 4:
        return None
    (length,) = struct.unpack("<I", prefix)
    head = stream.read(length)
    if len(head) < length:
        return None
    header = json.loads(head)
    payload = stream.read(header["size"])
    return (header, payload) if len(payload) == header["size"] else None


class Session:
    """The open document and page of this process."""

    def __init__(self, pdfium):
        self.pdfium, self.doc, self.page = pdfium, None, None

    def handle(self, header: dict, data: bytes) -> tuple[dict, bytes | memoryview]:
        op = header["op"]
        if op == "open":
            self.close()
            self.doc = self.pdfium.PdfDocument(header["path"] or data)
            return {"pages": len(self.doc)}, b""
        if op == "load":
            self.close_page()
            self.page = self.doc[header["page"] - 1]  # pdfium parses the content (and its forms) here
            width, height = self.page.get_size()
            return {"width": width, "height": height}, b""
        if op == "draw":
            bitmap = self.page.render(scale=header["scale"])
            try:
                return {"width": bitmap.width, "height": bitmap.height, "stride": bitmap.stride}, bytes(bitmap.buffer)
            finally:
                bitmap.close()
        self.close()
        return {}, b""

    def close_page(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None

    def close(self) -> None:
        self.close_page()
        if self.doc is not None:
            self.doc.close()
            self.doc = None


def main() -> None:
    """argv: the address space this process may use, in MB. Answers commands on stdin until it ends."""
    try:
        import resource
    except ImportError:  # Windows: the caller's deadline is the only limit
        resource = None
    if resource is not None:
        limit = int(sys.argv[1]) * MB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller, which ends this process
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever pdfium prints goes to stderr, never into the replies
    commands = sys.stdin.buffer
    import pypdfium2 as pdfium

    session = Session(pdfium)
    send(replies, {"ready": True})
    while (message := receive(commands)) is not None:
        try:
            reply, payload = session.handle(*message)
        except pdfium.PdfiumError as e:
            reply, payload = {"error": str(e)}, b""
        send(replies, reply, payload)
