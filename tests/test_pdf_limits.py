"""PDF bombs: pages that would take pdfium gigabytes or minutes (forms that each draw the next
twice, 22 deep, in 4 KB; a content stream that inflates 500-fold) are refused by page number
within the page limits, cost this process nothing, and never stop a server."""

from __future__ import annotations

import base64
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from qvl.processing import pdf
from qvl.processing.pdf import PageLimits, PdfError, page_count, render_pages

PLAIN = b"0 0 m 600 800 l S"  # an ordinary page: one stroke


def stream(data: bytes, entries: bytes = b"") -> bytes:
    return b"<< /Length %d %s >>\nstream\n" % (len(data), entries) + data + b"\nendstream"


def write_pdf(contents: list[bytes], forms: list[bytes] = ()) -> bytes:
    """A PDF written byte by byte: 600 x 800 point pages whose content streams are `contents`
    (whole stream objects), and Form XObjects drawing `forms`, each naming the next one /F (the
    pages name the first)."""
    n = len(contents)
    first_form = 3 + 2 * n
    resources = b"<< /XObject << /F %d 0 R >> >>" % first_form
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % (3 + 2 * k) for k in range(n)), n)]
    for k, content in enumerate(contents):
        objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 600 800] /Contents %d 0 R /Resources %s >>"
                    % (4 + 2 * k, resources), content]
    for k, body in enumerate(forms):
        objects.append(stream(body, b"/Type /XObject /Subtype /Form /BBox [0 0 600 800] /Resources "
                                    b"<< /XObject << /F %d 0 R >> >>" % (first_form + k + 1)))
    out, offsets = bytearray(b"%PDF-1.7\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def inflating(unit: bytes, megabytes: int) -> bytes:
    """A FlateDecode content stream of `unit` repeated to `megabytes` MB, compressed piecewise
    (this process never holds the inflated text)."""
    packer = zlib.compressobj(9)
    chunk = unit * (1024 * 1024 // len(unit))
    data = b"".join(packer.compress(chunk) for _ in range(megabytes)) + packer.flush()
    return stream(data, b"/Filter /FlateDecode")


def nested_forms(depth: int) -> bytes:
    """Page 1 plain; page 2 draws form 1, which draws form 2 twice, ... : 2^depth strokes."""
    return write_pdf([stream(PLAIN), stream(b"/F Do")], [b"/F Do /F Do"] * (depth - 1) + [PLAIN])


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {"forms": nested_forms(22),  # 4 KB; pdfium needed 3 GB at depth 21
            "inflate": write_pdf([stream(PLAIN), inflating(b"0 0 m 9 9 l S\n", 200)])}  # 400 KB -> 200 MB


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_the_bombs_are_small_files(bombs):
    assert len(bombs["forms"]) < 5000 and len(bombs["inflate"]) < 500_000
    assert page_count(bombs["forms"]) == page_count(bombs["inflate"]) == 2  # opening them costs nothing


@pytest.mark.parametrize("kind", ["forms", "inflate"])
def test_a_bomb_page_is_refused_by_number_and_costs_this_process_nothing(bombs, kind):
    before, started = rss_mb(), time.monotonic()
    with pytest.raises(PdfError, match=r"^page 2 of the PDF exceeds the limit of 1024 MB of memory to draw"):
        render_pages(bombs[kind], max_pixels=256 * 1024)
    assert time.monotonic() - started < 60
    assert rss_mb() - before < 64
    page, = render_pages(bombs[kind], "1", max_pixels=256 * 1024)  # the same document's good page, drawn
    assert page.size == (444, 592) and page.getpixel((5, 5)) == (255, 255, 255)


def test_a_page_that_draws_too_long_is_stopped_at_the_deadline():
    data = write_pdf([inflating(b"q Q\n", 200)])  # little memory, seconds of parsing
    started = time.monotonic()
    with pytest.raises(PdfError, match=r"^page 1 of the PDF exceeds the limit of 0.5 s to draw"):
        render_pages(data, max_pixels=4096, limits=PageLimits(seconds=0.5))
    assert time.monotonic() - started < 5


def test_workers_are_reused_and_draw_in_parallel():
    """Threads draw at once (each in its own worker), every page right; a worker is kept for
    the next document."""
    greys = [0.2, 0.4, 0.6]
    data = write_pdf([stream(b"%.1f g 0 0 600 800 re f" % g) for g in greys])
    with ThreadPoolExecutor(4) as pool:
        drawn = list(pool.map(lambda _: render_pages(data, max_pixels=4096), range(4)))
    assert [[p.getpixel((5, 5))[0] for p in pages] for pages in drawn] == [[round(255 * g) for g in greys]] * 4
    kept = {w.proc.pid for w in pdf.IDLE}
    assert kept and len(kept) <= pdf.KEEP_WORKERS
    render_pages(data, "1", max_pixels=4096)
    assert {w.proc.pid for w in pdf.IDLE} == kept  # no new process for the next document


def test_the_server_answers_400_naming_the_page_and_keeps_serving(tiny_engine, bombs):
    from fastapi.testclient import TestClient

    from tests.test_documents import pdf_bytes
    from tests.test_server_api import assert_error, make_app, wait_ready

    def ask(data: bytes):
        url = "data:application/pdf;base64," + base64.b64encode(data).decode()
        return client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Read it."}]}]})

    with TestClient(make_app(tiny_engine, warm_up=False)) as client:
        wait_ready(client)
        assert ask(pdf_bytes(1)).status_code == 200
        before = rss_mb()
        error = assert_error(ask(bombs["forms"]), 400, code="invalid_image")
        assert "page 2 of the PDF exceeds the limit of 1024 MB of memory" in error["message"]
        assert rss_mb() - before < 64
        answer = ask(pdf_bytes(2))
        assert answer.status_code == 200 and answer.json()["qvl"]["image_tokens"] > 0
