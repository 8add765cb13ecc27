"""Documents and grounding: PDF pages wherever an image goes (fixtures written here: several
pages, a rotated page, encrypted, corrupt, empty, oversized), grounding answers read into
exact pixels of the image as shown, drawn; through qvl ask, the API and a resumable batch."""

from __future__ import annotations

import base64
import io
import json
import math
import signal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from qvl.engine import Engine, EngineOptions, Request, RequestError
from qvl.grounding import Box, Point, draw, grounding, parse, to_pixels
from qvl.processing.pdf import PdfError, parse_pages, render_pages, split_pages
from qvl.sampling import SamplingParams


def pdf_bytes(pages: int, size=(600, 800), rotate: dict | None = None, encrypt: str | None = None) -> bytes:
    """A PDF of `pages` pages, page k a flat grey k*20 (so pages are told apart), rotated or
    encrypted with pypdf when asked."""
    images = [Image.new("RGB", size, (20 * k,) * 3) for k in range(1, pages + 1)]
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:], resolution=72)
    if not (rotate or encrypt):
        return buf.getvalue()
    import pypdf

    writer = pypdf.PdfWriter(clone_from=io.BytesIO(buf.getvalue()))
    for number, degrees in (rotate or {}).items():
        writer.pages[number - 1].rotate(degrees)
    if encrypt:
        writer.encrypt(encrypt)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def odd_pdf(width: float, height: float, pages: int = 1) -> bytes:
    import pypdf

    writer = pypdf.PdfWriter()
    for _ in range(pages):
        writer.add_blank_page(width=width, height=height)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


# -- grounding: reading answers, exact pixels --------------------------------------------------


@pytest.mark.parametrize("text", [
    '[{"bbox_2d": [10, 20, 300, 400], "label": "cat"}]',
    '```json\n[\n  {"bbox_2d": [10, 20, 300, 400], "label": "cat"}\n]\n```',
    'Here they are: [{"bbox_2d": [10, 20, 300, 400], "label": "cat"}] and that is all.',
    '[{"bbox_2d": [300, 400, 10, 20], "label": "cat"}, {"bbox_2d": [1, 2, 3',  # swapped corners, cut off
    '{"bbox_2d": [10, 20, 300, 400], "label": "cat"}',  # one object, no list
])
def test_answers_are_read_tolerantly(text):
    boxes, points = parse(text)
    assert boxes == [Box(10, 20, 300, 400, "cat")] and points == []


def test_points_mixed_labels_and_malformed_answers():
    boxes, points = parse('[{"point_2d": [500, 250], "label": "eye"}, {"point_2d": [1, "x"]}, '
                          '{"bbox_2d": [1, 2, 3]}, {"point_2d": [7, 8], "label": {"kind": "dot"}}]')
    assert boxes == [] and points == [Point(500, 250, "eye"), Point(7, 8, '{"kind": "dot"}')]
    for bad in ["", "no boxes here", "[{'bbox_2d': [1, 2, 3, 4]}]", '[{"bbox_2d": [NaN, 1, 2, 3]}]', "{" * 50]:
        assert grounding(bad, (100, 100)) == {"boxes": [], "points": []}


BOXY = st.one_of(st.text(), st.lists(st.one_of(
    st.fixed_dictionaries({"bbox_2d": st.lists(st.one_of(st.integers(-5000, 5000), st.floats(allow_nan=True)),
                                                min_size=0, max_size=5), "label": st.text(max_size=8)}),
    st.fixed_dictionaries({"point_2d": st.lists(st.integers(-5000, 5000), min_size=0, max_size=3)}),
    st.text(max_size=8))).map(lambda items: json.dumps(items)[: len(json.dumps(items)) * 3 // 4]))  # cut off too


@settings(max_examples=300, deadline=None)
@given(BOXY)
def test_any_answer_gives_boxes_inside_the_image_never_an_error(text):
    found = grounding(text, (640, 480))
    for box in found["boxes"]:
        x1, y1, x2, y2 = box["bbox_2d"]
        assert all(isinstance(v, int) for v in box["bbox_2d"]) and 0 <= x1 <= x2 <= 640 and 0 <= y1 <= y2 <= 480
    for point in found["points"]:
        x, y = point["point_2d"]
        assert isinstance(x, int) and isinstance(y, int) and 0 <= x <= 640 and 0 <= y <= 480


@pytest.mark.parametrize("width,height", [(1, 1), (7, 3), (640, 480), (480, 640), (1920, 1080), (4032, 3024),
                                          (333, 10001)])
def test_relative_coordinates_become_exact_pixels(width, height):
    values = [0, 1, 250, 499, 500, 501, 999, 1000]
    boxes = [Box(v, v, 1000, 1000) for v in values]
    points = [Point(v, 1000 - v) for v in values]
    px_boxes, px_points = to_pixels(boxes, points, width, height)
    for v, box, point in zip(values, px_boxes, px_points):
        assert (box.x1, box.y1, box.x2, box.y2) == (math.floor(v * width / 1000 + 0.5),
                                                    math.floor(v * height / 1000 + 0.5), width, height)
        assert (point.x, point.y) == (math.floor(v * width / 1000 + 0.5),
                                      math.floor((1000 - v) * height / 1000 + 0.5))
    beyond = to_pixels([Box(-5, -5, 1200, 1001)], [], width, height)[0][0]
    assert (beyond.x1, beyond.y1, beyond.x2, beyond.y2) == (0, 0, width, height)  # clamped to the image


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, max_image_tokens=64))


@pytest.mark.parametrize("orientation,shown", [(1, (300, 200)), (3, (300, 200)), (6, (200, 300)), (8, (200, 300))])
def test_boxes_are_in_the_pixels_of_the_image_as_shown(engine, orientation, shown):
    """A 300x200 photo whose EXIF says to turn it: the boxes are in the turned picture's pixels."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (300, 200), "white").save(buf, "JPEG", exif=exif.tobytes())
    parsed = engine.parse(Request([{"role": "user", "content": [{"type": "image", "image": buf.getvalue()}]}]))
    assert parsed.images[0].shown_size == shown
    found = grounding('[{"bbox_2d": [100, 250, 600, 1000], "label": "x"}]', parsed.images[0].shown_size)
    w, h = shown
    assert found["boxes"][0]["bbox_2d"] == [round(0.1 * w), round(0.25 * h), round(0.6 * w), h]


def test_drawn_boxes_land_on_their_pixels():
    found = {"boxes": [{"bbox_2d": [10, 20, 110, 90], "label": "cat"}], "points": [{"point_2d": [150, 50], "label": ""}]}
    out = np.asarray(draw(Image.new("RGB", (200, 120), "white"), found))
    assert tuple(out[55, 10]) != (255, 255, 255) and tuple(out[55, 110]) != (255, 255, 255)  # the box's sides
    assert tuple(out[55, 60]) == (255, 255, 255)  # its inside is left alone
    assert tuple(out[50, 150]) != (255, 255, 255)  # the point


# -- PDFs ------------------------------------------------------------------------------------


def test_page_selection():
    assert split_pages("a/doc.pdf#pages=2-4") == ("a/doc.pdf", "2-4")
    assert split_pages("a/doc.pdf") == ("a/doc.pdf", None)
    assert parse_pages("2-4,7,3", 9) == [2, 3, 4, 7]
    assert parse_pages(None, 3) == [1, 2, 3]
    for bad, words in [("0", "count from 1"), ("4-2", "ranges go up"), ("x", "bad page selection"),
                       ("10", "has 9 pages")]:
        with pytest.raises(PdfError, match=words):
            parse_pages(bad, 9)


def test_pages_are_drawn_at_the_budget_with_their_rotation():
    data = pdf_bytes(3, rotate={2: 90})
    pages = render_pages(data, max_pixels=64 * 1024)
    assert [p.size for p in pages] == [(222, 296), (296, 222), (222, 296)]  # page 2 turned, as readers show it
    assert all(abs(p.width * p.height - 64 * 1024) < 1200 for p in pages)
    assert [p.getpixel((5, 5))[0] for p in pages] == [20, 40, 60]  # in order, each its own page
    assert [p.getpixel((5, 5))[0] for p in render_pages(data, "3,1", max_pixels=4096)] == [60, 20]


@pytest.mark.parametrize("data,words", [
    (pdf_bytes(2, encrypt="secret"), "encrypted"),
    (b"%PDF-1.7\n" + bytes(range(256)) * 8, "not a readable PDF"),
    (pdf_bytes(2)[:300], "not a readable PDF"),  # truncated
    (odd_pdf(600, 800, pages=0), "has no pages"),
    (odd_pdf(20000, 800), "outside what PDF allows"),
    (odd_pdf(14000, 20), "aspect ratio"),
])
def test_bad_pdfs_are_refused_by_name_and_the_engine_keeps_serving(engine, data, words):
    request = Request([{"role": "user", "content": [{"type": "text", "text": "Read it."},
                                                    {"type": "image", "image": data}]}])
    with pytest.raises(RequestError, match=words) as caught:
        engine.parse(request)
    assert caught.value.param == "messages[0].content[1]" and caught.value.code == "invalid_image"
    ok = engine.generate(Request([{"role": "user", "content": [{"type": "image", "image": pdf_bytes(1)}]}],
                                 SamplingParams(temperature=0, max_new_tokens=2)))
    assert ok.usage.image_tokens > 0


def test_too_many_pages_and_pages_count_as_images(engine, tmp_path):
    path = tmp_path / "long.pdf"
    path.write_bytes(pdf_bytes(12, size=(60, 80)))
    with pytest.raises(RequestError, match="12 pages asked for, but only 8"):
        engine.parse(Request([{"role": "user", "content": [{"type": "image", "image": str(path)}]}]))
    parsed = engine.parse(Request([{"role": "user", "content": [{"type": "image", "image": f"{path}#pages=2-4"}]}]))
    assert len(parsed.images) == 3


# -- front doors -------------------------------------------------------------------------------

BOX_ANSWER = '[{"bbox_2d": [100, 200, 500, 800], "label": "cat"}]'
BOX_REGEX = r'\[\{"bbox_2d": \[100, 200, 500, 800\], "label": "cat"\}\]'  # a constructed answer, forced


@pytest.mark.slow  # `qvl ask` over every page, twice
def test_qvl_ask_detect_draws_every_page(tiny_checkpoint, tmp_path, capsys):
    from qvl.cli import main

    doc = tmp_path / "doc.pdf"
    doc.write_bytes(pdf_bytes(3, rotate={2: 90}))
    out = tmp_path / "boxes.png"
    code = main(["ask", "-i", f"{doc}#pages=1-2", "--task", "detect", "cats", "--model", str(tiny_checkpoint),
                 "--weights", "fp32", "--threads", "2", "--max-image-tokens", "64", "--regex", BOX_REGEX,
                 "--max-new-tokens", "40", "--json", "--draw", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in rows] == [f"{doc}#pages=1", f"{doc}#pages=2"]  # one question per page
    assert rows[0]["text"] == BOX_ANSWER
    assert rows[0]["boxes"] == [{"bbox_2d": [22, 59, 111, 237], "label": "cat"}]  # 222 x 296 page
    assert rows[1]["boxes"] == [{"bbox_2d": [30, 44, 148, 178], "label": "cat"}]  # 296 x 222, turned
    for k, row in enumerate(rows, 1):
        drawn = Image.open(tmp_path / f"boxes-{k}.png")
        assert row["drawn"] == str(tmp_path / f"boxes-{k}.png") and drawn.size in ((222, 296), (296, 222))
    assert main(["ask", "--task", "detect", "--model", str(tiny_checkpoint), "-i", str(doc)]) != 0
    assert "needs the categories" in capsys.readouterr().err


def test_api_takes_pdf_pages_and_reports_boxes_in_pixels(engine):
    from fastapi.testclient import TestClient
    from tests.test_server_api import assert_error, make_app, wait_ready

    url = "data:application/pdf;base64," + base64.b64encode(pdf_bytes(3)).decode()
    with TestClient(make_app(engine)) as client:
        wait_ready(client)
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url,
                                                                                              "pages": "2-3"}},
                                                          {"type": "text", "text": "Find the cat."}]}],
                "structured_outputs": {"regex": BOX_REGEX}, "max_tokens": 40}
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        qvl = answer.json()["qvl"]
        assert qvl["image_size"] == [222, 296] and qvl["boxes"] == [{"bbox_2d": [22, 59, 111, 237], "label": "cat"}]
        assert qvl["image_tokens"] == 2 * 70  # two pages, each 320 x 224 pixels after resizing: 10 x 7 tokens
        body["messages"][0]["content"][0]["image_url"]["pages"] = "9"
        error = assert_error(client.post("/v1/chat/completions", json=body), 400,
                             "messages[0].content[0].image_url.url", "invalid_image")
        assert "page 9 asked for, but the PDF has 3 pages" in error["message"]
        plain = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2}).json()
        assert "boxes" not in plain["qvl"]  # no grounding in the answer: no boxes field


@pytest.mark.slow  # `qvl batch` subprocesses
def test_batch_takes_each_page_as_an_item_and_resumes_page_by_page(tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    from tests.test_batch_kill import wait_for_rows

    doc = tmp_path / "in" / "report.pdf"
    doc.parent.mkdir()
    doc.write_bytes(pdf_bytes(20, size=(60, 80)))
    out = tmp_path / "rows.jsonl"
    argv = [sys.executable, "-m", "qvl.cli", "batch", str(doc.parent), "--out", str(out), "--task", "markdown",
            "--max-new-tokens", "24", "--batch-size", "2", "--model", str(tiny_checkpoint), "--threads", "1",
            "--dtype", "fp32"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(out, proc, 3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    done_before = {json.loads(line)["id"] for line in out.read_text().splitlines()}
    assert 3 <= len(done_before) < 20, "the kill should land part-way"
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"skipped {len(done_before)}" in again.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["page"] for r in rows) == list(range(1, 21))  # no page lost, none repeated
    assert all(r["id"] == f"report.pdf#page={r['page']}" and r["pdf"] == str(doc) and "text" in r for r in rows)


def test_an_absurd_page_selection_is_refused_at_once():
    import time

    started = time.perf_counter()
    with pytest.raises(PdfError, match="20000000 pages asked for; at most 32"):
        parse_pages(",".join(["1-1000000"] * 20), 10**6, limit=32)
    with pytest.raises(PdfError, match="has 5000000 pages; at most 32"):
        parse_pages(None, 5 * 10**6, limit=32)
    assert time.perf_counter() - started < 0.1
