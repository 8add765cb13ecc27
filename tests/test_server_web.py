"""The web page in headless Chromium (Debian's `chromium`, driven by Playwright's Python
package): upload an image, pick a preset, watch the answer stream, stop it, ask a follow-up;
the JSON switch with a schema; videos; PDFs and their pages; the detect and point presets and
the boxes and points of an answer drawn over the image; the search box of a server with an index.

Set QVL_UPDATE_SCREENSHOT=1 to refresh docs/web-page.png from this run."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.test_cli_structured import SCHEMA, Answer
from tests.test_server_support import live_server, png_bytes

CHROMIUM = shutil.which("chromium")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                                   "(apt-get install -y chromium) so the web page cannot be driven")]
# The network here is closed: without these flags Chromium waits on background connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "web-page.png"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with live_server(tiny_checkpoint) as s:
        yield s


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 760})
        context.set_default_timeout(30_000)
        yield context.pages[0] if context.pages else context.new_page()
        context.close()


def scene_png(path: Path) -> None:
    """A small picture worth describing: sky, sun, a house and a line of text."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (360, 260), (135, 196, 235))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 190, 360, 260), fill=(90, 160, 80))
    draw.ellipse((270, 20, 330, 80), fill=(250, 210, 60))
    draw.rectangle((60, 120, 170, 200), fill=(200, 80, 60))
    draw.polygon([(50, 120), (115, 70), (180, 120)], fill=(120, 60, 40))
    draw.rectangle((100, 160, 130, 200), fill=(70, 40, 30))
    draw.text((200, 215), "OPEN 9:00-17:00", fill=(255, 255, 255))
    img.save(path)


def wait_until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def sent_messages(page, action) -> list[dict]:
    """Run `action` and return the messages of the chat request it sends."""
    with page.expect_request("**/v1/chat/completions") as request:
        action()
    return json.loads(request.value.post_data)["messages"]


def test_upload_preset_stream_stop_follow_up(server, page, tmp_path):
    image = tmp_path / "scene.png"
    scene_png(image)
    page.goto(f"{server.url}/")
    load_ms = page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
    assert load_ms < 1000, f"the page took {load_ms:.0f} ms to load"
    page.wait_for_selector("#status:has-text('ready')")

    page.set_input_files("#file", str(image))
    page.wait_for_selector("#preview:visible")
    messages = sent_messages(page, lambda: page.click("#presets button[data-task=describe]"))
    assert messages[0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    # Polled from here: wait_for_function evaluates a string in the page, which its CSP forbids
    wait_until(lambda: page.evaluate("document.querySelector('.msg.assistant.streaming')?.textContent.length > 5"),
               timeout_s=30)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant.stopped")
    assert page.is_disabled("#stop") and page.is_enabled("#ask")
    wait_until(lambda: 'qvl_cancelled_total{reason="disconnect"} 1' in httpx.get(f"{server.url}/metrics").text)
    partial = page.text_content(".msg.assistant")

    page.fill("#max-tokens", "6")
    page.fill("#question", "And what colour is it?")
    follow_up = sent_messages(page, lambda: page.click("#ask"))
    assert [m["role"] for m in follow_up] == ["user", "assistant", "user"]
    assert follow_up[1]["content"] == partial and follow_up[2]["content"][0]["text"] == "And what colour is it?"
    page.wait_for_selector("#stats:has-text('tokens/s')")
    assert page.locator(".msg").count() == 4 and page.locator(".msg.streaming").count() == 0
    assert "time to first token" in page.text_content("#stats")
    page.screenshot(path=str(tmp_path / "web-page.png"))
    if os.environ.get("QVL_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.write_bytes((tmp_path / "web-page.png").read_bytes())


def test_paste_drop_and_plain_errors(server, page):
    page.goto(f"{server.url}/")
    page.wait_for_selector("#status:has-text('ready')")
    page.evaluate("""() => {  // paste an image, as Ctrl+V on a screenshot would
        const data = new DataTransfer();
        data.items.add(new File(['not really an image'], 'broken.png', {type: 'image/png'}));
        document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: data}));
    }""")
    page.wait_for_selector("#image-info:has-text('broken.png')")
    page.fill("#max-tokens", "4")
    page.click("#presets button[data-task=ocr]")
    page.wait_for_selector("#error:visible")
    assert "not a supported image" in page.text_content("#error")
    assert page.locator(".msg.assistant").count() == 0  # the failed question can simply be asked again

    page.evaluate("""(b64) => {  // drop a real image on the drop zone
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], 'dropped.png', {type: 'image/png'}));
        document.getElementById('drop').dispatchEvent(new DragEvent('drop', {dataTransfer: data, bubbles: true}));
    }""", base64.b64encode(png_bytes(64, 64)).decode())
    page.wait_for_selector("#image-info:has-text('dropped.png')")
    assert page.is_hidden("#error")
    page.click("#presets button[data-task=ocr]")
    page.wait_for_selector("#stats:has-text('tokens/s')")
    assert page.text_content(".msg.assistant")


def test_json_switch_sends_the_schema_and_shows_the_answer_parsed(server, page):
    page.goto(f"{server.url}/")
    page.wait_for_selector("#status:has-text('ready')")
    assert page.is_hidden("#json-schema")
    page.check("#json-mode")
    sent = []
    page.on("request", lambda r: sent.append(r.url) if "chat/completions" in r.url else None)
    page.fill("#json-schema", "{not json")
    page.fill("#question", "What colour is it?")
    page.click("#ask")
    page.wait_for_selector("#error:visible")
    assert "not valid JSON" in page.text_content("#error")
    assert not sent and page.locator(".msg").count() == 0
    assert page.input_value("#question") == "What colour is it?"  # kept for when the schema is fixed

    page.fill("#json-schema", json.dumps(SCHEMA, indent=1))
    page.fill("#max-tokens", "200")  # SCHEMA is bounded: every answer ends well before
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#ask")
    assert json.loads(request.value.post_data)["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    page.wait_for_selector(".msg.assistant.json")
    assert page.is_hidden("#error")
    shown = page.text_content(".msg.assistant.json")
    Answer.model_validate(json.loads(shown))
    assert shown.startswith('{\n  "colour": ')  # pretty-printed

    page.fill("#json-schema", "")
    page.fill("#question", "Anything else?")
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#ask")
    assert json.loads(request.value.post_data)["response_format"] == {"type": "json_object"}
    wait_until(lambda: page.locator(".msg.assistant").count() == 2
               and page.locator(".msg.assistant.streaming").count() == 0, timeout_s=60)


def test_a_thinking_models_reasoning_is_shown_apart(tmp_path_factory, page):
    from qvl.synth import write_checkpoint

    checkpoint = write_checkpoint(tmp_path_factory.mktemp("thinking"), "tiny", seed=0, thinking=True)
    with live_server(checkpoint, "--reasoning-budget", "4") as server:
        page.goto(f"{server.url}/")
        page.wait_for_selector("#status:has-text('ready')")
        page.fill("#max-tokens", "10")
        page.fill("#question", "Why?")
        page.click("#ask")
        page.wait_for_selector("#stats:has-text('tokens/s')")
        thought, answer = page.text_content(".msg.thinking"), page.text_content(".msg.assistant")
        final = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Why?"}]}], "max_tokens": 10,
            "temperature": 0, "seed": 0}).json()["choices"][0]["message"]
        assert thought and answer and thought != answer
        assert len(final["reasoning_content"]) > 0  # the same split the page shows


def drop_file(page, name: str, mime: str, data: bytes) -> None:
    """Drop a file on the drop zone, as dragging it from the desktop would."""
    page.evaluate("""([name, mime, b64]) => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], name, {type: mime}));
        document.getElementById('drop').dispatchEvent(new DragEvent('drop', {dataTransfer: data, bubbles: true}));
    }""", [name, mime, base64.b64encode(data).decode()])


def stream_usage(response) -> tuple[dict, dict]:
    """The usage and the "qvl" extension of a streamed chat completion the page received."""
    chunks = [json.loads(line[5:]) for line in response.text().splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    return next(c["usage"] for c in chunks if c.get("usage")), next(c["qvl"] for c in chunks if c.get("qvl"))


def answered(page, count: int, timeout_s: float = 60) -> None:
    """Wait until `count` answers are on the page, none still streaming."""
    wait_until(lambda: page.locator(".msg.assistant").count() == count
               and page.locator(".msg.assistant.streaming").count() == 0, timeout_s=timeout_s)


def test_video_upload_question_follow_up_and_remove(server, page, tmp_path):
    from qvl.bench import synthetic_clip

    clip = synthetic_clip(tmp_path / "clip.mp4", seconds=2, width=160, height=96, fps=10)
    csp = page.goto(f"{server.url}/").headers["content-security-policy"]
    assert "media-src blob:" in csp  # the preview plays from a blob: URL
    page.wait_for_selector("#status:has-text('ready')")
    assert "video/*" in page.get_attribute("#file", "accept")

    page.set_input_files("#file", str(clip))  # the file picker
    page.wait_for_selector("#video-info:has-text('clip.mp4')")
    assert page.is_visible("#video-box") and page.is_hidden("#preview")  # no image
    muted, controls = page.evaluate("[document.getElementById('video-preview').muted, "
                                    "document.getElementById('video-preview').controls]")
    assert muted and controls
    page.wait_for_selector("#video-info:has-text('2.0 s')")  # the preview read the clip's length
    assert page.is_visible("#video-preview") and page.is_hidden("#video-fallback")

    page.fill("#max-tokens", "6")
    page.fill("#question", "What moves in this clip?")
    with page.expect_response("**/v1/chat/completions") as response:
        messages = sent_messages(page, lambda: page.click("#ask"))
    assert [p["type"] for p in messages[0]["content"]] == ["video_url", "text"]
    url = messages[0]["content"][0]["video_url"]["url"]
    assert url.startswith("data:video/mp4;base64,")
    assert base64.b64decode(url.partition(",")[2]) == clip.read_bytes()
    answered(page, 1)
    assert page.text_content(".msg.assistant") and page.is_hidden("#error")
    assert "tokens/s" in page.text_content("#stats")
    with_clip, extension = stream_usage(response.value)
    assert extension["video_tokens"] > 0 and extension["image_tokens"] == 0

    page.fill("#question", "And then?")
    follow_up = sent_messages(page, lambda: page.click("#ask"))  # the clip rides along in the first question
    assert [m["role"] for m in follow_up] == ["user", "assistant", "user"]
    assert follow_up[0]["content"][0]["video_url"]["url"] == url
    assert follow_up[2]["content"] == [{"type": "text", "text": "And then?"}]
    answered(page, 2)

    page.click("#clear-video")  # removed before asking: a new conversation without the clip
    assert page.is_hidden("#video-box") and page.locator(".msg").count() == 0
    page.fill("#question", "What moves in this clip?")
    with page.expect_response("**/v1/chat/completions") as response:
        after = sent_messages(page, lambda: page.click("#ask"))
    assert after == [{"role": "user", "content": [{"type": "text", "text": "What moves in this clip?"}]}]
    answered(page, 1)
    without_clip, _ = stream_usage(response.value)
    assert with_clip["prompt_tokens"] > without_clip["prompt_tokens"] + 8  # the clip's frames were in the prompt


def test_too_large_and_corrupt_videos_show_plain_errors(server, page):
    page.goto(f"{server.url}/")
    page.wait_for_selector("#status:has-text('ready')")
    sent = []
    page.on("request", lambda r: sent.append(r) if "chat/completions" in r.url else None)

    page.evaluate("""() => {  // 16 MB: over the 20 MB request limit once base64-encoded
        const data = new DataTransfer();
        data.items.add(new File([new Uint8Array(16 * 1024 * 1024)], 'huge.mp4', {type: 'video/mp4'}));
        document.getElementById('drop').dispatchEvent(new DragEvent('drop', {dataTransfer: data, bubbles: true}));
    }""")
    page.wait_for_selector("#error:visible")
    assert "too large" in page.text_content("#error") and "20 MB" in page.text_content("#error")
    assert page.is_hidden("#video-box")

    drop_file(page, "broken.mp4", "video/mp4", b"these bytes are not a video " * 40)
    page.wait_for_selector("#video-info:has-text('broken.mp4')")
    assert page.is_hidden("#error")  # a new attachment starts a new conversation, errors cleared
    page.fill("#max-tokens", "4")
    page.fill("#question", "What happens?")
    page.click("#ask")
    page.wait_for_selector("#error:visible")
    assert "not a readable video" in page.text_content("#error")  # the server's own message
    assert page.locator(".msg.assistant").count() == 0  # the failed question can simply be asked again
    assert page.is_enabled("#ask") and page.is_disabled("#stop")
    assert [p["type"] for p in json.loads(sent[0].post_data)["messages"][0]["content"]] == ["video_url", "text"]

    page.click("#clear-video")
    page.fill("#question", "Hello?")
    text_only = sent_messages(page, lambda: page.click("#ask"))
    assert text_only == [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]
    page.wait_for_selector("#stats:has-text('tokens/s')")
    assert page.text_content(".msg.assistant") and page.is_hidden("#error")


# -- documents and grounding ----------------------------------------------------------------------


def sse_fixture(answer: str, extension: dict) -> str:
    """A streamed chat completion as qvl serve sends it (its own schemas): the role, the answer
    in pieces, the finish_reason chunk carrying the "qvl" extension, the usage, [DONE]."""
    from qvl.server.schemas import ChatCompletionChunk, ChunkChoice, Usage

    def chunk(**fields) -> str:
        body = ChatCompletionChunk(id="chatcmpl-fixture", created=0, model="fixture", **fields)
        return f"data: {body.model_dump_json()}\n\n"

    pieces = [answer[i:i + 16] for i in range(0, len(answer), 16)]
    return "".join([chunk(choices=[ChunkChoice(delta={"role": "assistant", "content": ""})]),
                    *(chunk(choices=[ChunkChoice(delta={"content": p})]) for p in pieces),
                    chunk(choices=[ChunkChoice(delta={}, finish_reason="stop")], qvl=extension),
                    chunk(choices=[], usage=Usage(prompt_tokens=80, completion_tokens=len(pieces),
                                                  total_tokens=80 + len(pieces),
                                                  prompt_tokens_details={"cached_tokens": 0})),
                    "data: [DONE]\n\n"])


def grounding_fixture(answer: str, size: tuple[int, int] | None) -> tuple[str, dict]:
    """The body the server would stream for `answer` about an image of `size` (width, height):
    boxes and points read by the server's own parser, in that image's pixels."""
    from qvl.grounding import grounding

    extension = {"timings": {"ttft_ms": 20.0, "decode_ms_per_token": 10.0}, "image_tokens": 64, "video_tokens": 0}
    found = grounding(answer, size)
    if found["boxes"] or found["points"]:
        extension.update(found, image_size=list(size) if size else None)
    return sse_fixture(answer, extension), extension


def assert_overlay_matches(page, extension: dict) -> None:
    """Each box and point of `extension` sits where it belongs on the preview as shown now,
    within a pixel and a half."""
    shown = page.locator("#preview").bounding_box()
    width, height = extension["image_size"]
    sx, sy = shown["width"] / width, shown["height"] / height
    for box in extension["boxes"]:
        x1, y1, x2, y2 = box["bbox_2d"]
        got = page.locator(f"#overlay .box[data-label='{box['label']}']").bounding_box()
        want = {"x": shown["x"] + x1 * sx, "y": shown["y"] + y1 * sy, "width": (x2 - x1) * sx, "height": (y2 - y1) * sy}
        assert all(abs(got[k] - want[k]) <= 1.5 for k in want), (box, got, want)
    for point in extension["points"]:
        x, y = point["point_2d"]
        got = page.locator(f"#overlay .point[data-label='{point['label']}']").bounding_box()
        centre = (got["x"] + got["width"] / 2, got["y"] + got["height"] / 2)
        want = (shown["x"] + x * sx, shown["y"] + y * sy)
        assert abs(centre[0] - want[0]) <= 1.5 and abs(centre[1] - want[1]) <= 1.5, (point, centre, want)
    assert page.locator("#overlay .mark").count() == len(extension["boxes"]) + len(extension["points"])


def test_boxes_and_points_are_drawn_over_the_image(server, page, tmp_path):
    from PIL import Image

    scene_png(tmp_path / "small.png")
    photo = tmp_path / "photo.png"  # larger than the preview: shown scaled down
    Image.open(tmp_path / "small.png").resize((1600, 1000)).save(photo)
    found = ('```json\n[\n  {"bbox_2d": [139, 269, 500, 769], "label": "house"},\n'
             '  {"bbox_2d": [750, 77, 917, 308], "label": "sun"},\n'
             '  {"point_2d": [319, 692], "label": "door"}\n]\n```')
    replies = [grounding_fixture(found, (1600, 1000)),
               grounding_fixture('[{"bbox_2d": [0, 0, 1000, 730], "label": "sky"}]', (1600, 1000)),
               grounding_fixture("No boxes in this answer.", (1600, 1000)),
               grounding_fixture('[{"bbox_2d": [10, 10, 500, 500], "label": "cat"}]', (1600, 1000)),
               grounding_fixture('[{"bbox_2d": [10, 10, 500, 500], "label": "cat"}]', (1600, 1000)),
               grounding_fixture('[{"bbox_2d": [10, 10, 500, 500], "label": "page"}]', (1240, 1754))]  # a PDF page
    sent = []

    def fulfil(route):
        sent.append(json.loads(route.request.post_data))
        body, _ = replies[len(sent) - 1]
        route.fulfill(status=200, content_type="text/event-stream", body=body)

    page.route("**/v1/chat/completions", fulfil)
    page.goto(f"{server.url}/")
    page.set_input_files("#file", str(photo))
    page.wait_for_selector("#preview:visible")
    page.fill("#question", "Where is the house?")
    page.click("#ask")
    page.wait_for_selector("#overlay .box[data-label=house]")
    answered(page, 1)
    assert sent[0]["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    extension = replies[0][1]
    assert [b["label"] for b in extension["boxes"]] == ["house", "sun"] and extension["points"][0]["label"] == "door"
    shown = page.locator("#preview").bounding_box()
    assert shown["width"] < 800  # scaled down: the overlay must scale with it
    assert_overlay_matches(page, extension)
    assert page.text_content("#overlay .box[data-label=house] .tag") == "house"  # a small visible tag
    assert "2 boxes and 1 point" in page.text_content("#overlay-info")

    assert page.is_hidden("#overlay-tip")
    page.hover("#overlay .box[data-label=house]")
    page.wait_for_selector("#overlay-tip:visible")
    page.screenshot(path=str(tmp_path / "overlay.png"))
    assert "house" in page.text_content("#overlay-tip")
    tip, house = page.locator("#overlay-tip").bounding_box(), page.locator("#overlay .box[data-label=house]").bounding_box()
    assert abs(tip["x"] - house["x"]) < 40 and house["y"] - 60 < tip["y"] < house["y"] + house["height"] + 20
    page.hover("#overlay .point[data-label=door]")
    wait_until(lambda: "door" in page.text_content("#overlay-tip"))
    page.mouse.move(5, 5)
    page.wait_for_selector("#overlay-tip", state="hidden")

    page.set_viewport_size({"width": 700, "height": 900})  # one column: the preview grows
    wait_until(lambda: page.locator("#preview").bounding_box()["width"] > shown["width"] + 100)
    assert_overlay_matches(page, extension)
    page.screenshot(path=str(tmp_path / "overlay-resized.png"))

    page.fill("#question", "And the sky?")  # a new answer replaces the overlay
    page.click("#ask")
    page.wait_for_selector("#overlay .box[data-label=sky]")
    assert page.locator("#overlay .mark").count() == 1
    assert_overlay_matches(page, replies[1][1])
    page.fill("#question", "Thanks.")  # an answer without boxes leaves none
    page.click("#ask")
    answered(page, 3)
    assert page.locator("#overlay .mark").count() == 0 and page.is_hidden("#overlay-info")

    page.fill("#question", "A cat?")
    page.click("#ask")
    page.wait_for_selector("#overlay .box[data-label=cat]")
    page.click("#new-chat")  # a new conversation clears it
    assert page.locator("#overlay .mark").count() == 0
    page.fill("#question", "A cat?")
    page.click("#ask")
    page.wait_for_selector("#overlay .box[data-label=cat]")
    page.click("#clear-image")  # so does removing the image
    assert page.locator("#overlay .mark").count() == 0 and page.is_hidden("#preview")

    drop_file(page, "doc.pdf", "application/pdf", pdf_bytes(1))  # a PDF page has no preview to draw on
    page.wait_for_selector("#pdf-info:has-text('doc.pdf')")
    page.fill("#question", "Where is the text?")
    page.click("#ask")
    page.wait_for_selector("#overlay-info:visible")
    assert page.locator("#overlay .mark").count() == 0
    assert "1 box" in page.text_content("#overlay-info") and "image only" in page.text_content("#overlay-info")


def pdf_bytes(pages: int) -> bytes:
    """A PDF of `pages` pages, each a picture with its number in it (Pillow writes it)."""
    import io

    from PIL import Image, ImageDraw

    images = []
    for n in range(1, pages + 1):
        img = Image.new("RGB", (300, 400), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        draw.text((30, 30), f"Page {n} of {pages}", fill=(0, 0, 0))
        draw.rectangle((30, 80, 270, 90 + 40 * n), outline=(0, 0, 0), width=2)
        images.append(img)
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:], resolution=72)
    return buf.getvalue()


def test_pdf_upload_pages_follow_up_and_a_page_out_of_range(server, page, tmp_path):
    document = tmp_path / "report.pdf"
    document.write_bytes(pdf_bytes(3))
    page.goto(f"{server.url}/")
    page.wait_for_selector("#status:has-text('ready')")
    assert "application/pdf" in page.get_attribute("#file", "accept")

    page.set_input_files("#file", str(document))
    page.wait_for_selector("#pdf-info:has-text('report.pdf')")
    assert "KB" in page.text_content("#pdf-info")  # its size
    assert page.is_visible("#pdf-box") and page.is_hidden("#preview") and page.is_hidden("#video-box")
    assert page.input_value("#pdf-pages") == "1"
    page.fill("#pdf-pages", "2")
    page.fill("#max-tokens", "4")
    page.fill("#question", "What is on this page?")
    with page.expect_response("**/v1/chat/completions") as response:
        messages = sent_messages(page, lambda: page.click("#ask"))
    part = messages[0]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["pages"] == "2"
    assert part["image_url"]["url"].startswith("data:application/pdf;base64,")
    assert base64.b64decode(part["image_url"]["url"].partition(",")[2]) == document.read_bytes()
    assert messages[0]["content"][1] == {"type": "text", "text": "What is on this page?"}
    answered(page, 1)
    assert page.text_content(".msg.assistant") and page.is_hidden("#error")
    _, extension = stream_usage(response.value)
    assert extension["image_tokens"] > 0  # the page was in the prompt

    page.fill("#question", "And below it?")  # the PDF rides along in the first question
    follow_up = sent_messages(page, lambda: page.click("#ask"))
    assert [m["role"] for m in follow_up] == ["user", "assistant", "user"]
    assert follow_up[0]["content"][0] == part and follow_up[2]["content"] == [{"type": "text", "text": "And below it?"}]
    answered(page, 2)

    page.fill("#pdf-pages", "2 to 4")  # not a page selection: said on the page, nothing sent
    page.fill("#question", "And page 9?")
    sent = []
    page.on("request", lambda r: sent.append(r) if "chat/completions" in r.url else None)
    page.click("#ask")
    page.wait_for_selector("#error:visible")
    assert "not a page selection" in page.text_content("#error") and not sent
    assert page.input_value("#question") == "And page 9?"  # kept for when the pages are fixed

    page.fill("#pdf-pages", "9")  # other pages: a new conversation about them
    page.click("#ask")
    page.wait_for_selector("#error:has-text('page 9')")
    assert "page 9 asked for, but the PDF has 3 pages" in page.text_content("#error")  # the server's own words
    assert json.loads(sent[-1].post_data)["messages"][0]["content"][0]["image_url"]["pages"] == "9"
    assert page.locator(".msg.assistant").count() == 0  # the failed question can simply be asked again
    assert page.locator(".msg.user").all_text_contents() == ["And page 9?"]  # the conversation before is gone
    assert page.is_enabled("#ask") and page.is_disabled("#stop")

    page.fill("#pdf-pages", "2-3")
    page.fill("#question", "What is on these pages?")
    again = sent_messages(page, lambda: page.click("#ask"))
    assert again[0]["content"][0]["image_url"]["pages"] == "2-3" and len(again) == 1
    answered(page, 1)
    assert page.is_hidden("#error") and "tokens/s" in page.text_content("#stats")

    page.click("#clear-pdf")  # removed: a new conversation without it
    assert page.is_hidden("#pdf-box") and page.locator(".msg").count() == 0
    page.fill("#question", "Hello?")
    assert sent_messages(page, lambda: page.click("#ask")) == [
        {"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]
    answered(page, 1)


def test_detect_and_point_presets_ask_for_the_categories(server, page, tmp_path):
    from qvl.tasks import TASKS

    image = tmp_path / "scene.png"
    scene_png(image)
    page.goto(f"{server.url}/")
    page.wait_for_selector("#status:has-text('ready')")
    page.set_input_files("#file", str(image))
    page.wait_for_selector("#preview:visible")
    page.fill("#max-tokens", "4")

    sent = []
    page.on("request", lambda r: sent.append(r) if "chat/completions" in r.url else None)
    page.click("#presets button[data-task=detect]")  # nothing to find yet: said, nothing sent
    page.wait_for_selector("#error:visible")
    assert "categories" in page.text_content("#error") and not sent
    assert page.evaluate("document.activeElement.id") == "subject-categories"

    page.fill("#subject-categories", "cats, bicycles")
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#presets button[data-task=detect]")
    body = json.loads(request.value.post_data)
    assert body["messages"][0]["content"][-1] == {"type": "text", "text": TASKS["detect"].prompt_for("cats, bicycles")}
    assert body["messages"][0]["content"][-1]["text"] == ("Locate every instance that belongs to the following "
                                                          "categories: 'cats, bicycles'. Report bbox coordinates "
                                                          "in JSON format.")  # the official prompt
    assert body["temperature"] == 0  # greedy, as the preset says
    assert page.text_content(".msg.user") == "find things: boxes: cats, bicycles"
    answered(page, 1)
    assert page.is_hidden("#error")

    page.fill("#subject-categories", "")  # the question box's text, when the field is empty
    page.fill("#question", "the door")
    follow_up = sent_messages(page, lambda: page.click("#presets button[data-task=point]"))
    assert follow_up[-1]["content"] == [{"type": "text", "text": TASKS["point"].prompt_for("the door")}]
    assert page.input_value("#question") == ""
    answered(page, 2)

    page.click("#new-chat")  # document parsing works as OCR does: greedy, its own image budget
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#presets button[data-task=markdown]")
    body = json.loads(request.value.post_data)
    assert body["messages"][0]["content"][-1]["text"] == TASKS["markdown"].prompt
    assert body["temperature"] == 0 and body["max_pixels"] == TASKS["markdown"].max_image_tokens * 32 * 32
    answered(page, 1)


def test_the_model_picker_chooses_the_model_that_answers(tiny_checkpoint, tiny_untied_checkpoint, page):
    with live_server(tiny_checkpoint, "--model", f"second={tiny_untied_checkpoint}") as server:
        page.goto(f"{server.url}/")
        page.wait_for_selector("#status:has-text('2 models')")
        wait_until(lambda: page.locator("#model option").count() == 2)
        assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [tiny_checkpoint.name,
                                                                                          "second"]
        page.select_option("#model", "second")
        page.fill("#max-tokens", "3")
        page.fill("#question", "hi")
        with page.expect_request("**/v1/chat/completions") as request:
            page.click("#ask")
        assert json.loads(request.value.post_data)["model"] == "second"
        page.wait_for_selector("#stats:has-text('tokens/s')")
        assert [m["name"] for m in httpx.get(f"{server.url}/api/ps").json()["models"]] == ["second:latest"]


def test_search_box_shows_the_results_thumbnails(tiny_embedding_checkpoint, page, tmp_path):
    """`qvl serve --index`: the page has a search box, and a query shows every entry's thumbnail
    (fetched by the page, shown from a blob: URL), score and file."""
    from playwright.sync_api import expect

    from tests.test_index import make_index
    from tests.test_retrieval import fp32_engine

    _, store, _ = make_index(fp32_engine(tiny_embedding_checkpoint), tmp_path)
    with live_server(tiny_embedding_checkpoint, "--index", str(store.folder)) as server:
        page.goto(server.url)
        page.fill("#search-query", "a grey page")
        page.click("#search-button")
        expect(page.locator('#search-results .hit img[src^="blob:"]')).to_have_count(6, timeout=60_000)  # every entry
        captions = page.locator("#search-results figcaption").all_inner_texts()
        assert any("doc.pdf, page 2" in c for c in captions) and any("img0.png" in c for c in captions)


@pytest.mark.parametrize("arch", ["qwen3-vl", "qwen3.5"])
def test_the_demo_models_examples_are_answered_right(page, arch):
    """./run.sh offline: a shipped demo model behind the page (the Qwen3.5 one thinking, as it
    does by default); each example button loads its picture, asks, and the answer shown is the
    right one."""
    from qvl.demo import shipped

    examples = Path(__file__).resolve().parents[1] / "src" / "qvl" / "server" / "static" / "examples"
    answers = json.loads((examples / "answers.json").read_text())
    with live_server(shipped.folder(arch)) as demo:
        page.goto(f"{demo.url}/")
        page.wait_for_selector("#status:has-text('ready')")
        shown = None
        for label, expected in (("read this text", answers["text.png"]),
                                ("the triangle's colour", answers["shapes.png"]["answer"])):
            page.locator("#examples button", has_text=label).click()
            done = "(() => { const m = document.querySelector('.msg.assistant'); return m && " \
                   "!m.classList.contains('streaming') ? m.textContent.trim() : null; })()"
            wait_until(lambda: page.evaluate(done) not in (None, shown), 60)  # a new conversation's answer
            shown = page.evaluate(done)
            assert shown == expected, label


def test_search_box_reranks_with_the_servers_reranker(tiny_embedding_checkpoint, tiny_reranker_checkpoint, page,
                                                     tmp_path):
    """`qvl serve --index --reranker`: the search box offers to rerank; checked, the search asks
    for it and each result shows its rerank score beside its score."""
    from playwright.sync_api import expect

    from tests.test_index import make_index
    from tests.test_retrieval import fp32_engine

    _, store, _ = make_index(fp32_engine(tiny_embedding_checkpoint), tmp_path)
    with live_server(tiny_embedding_checkpoint, "--index", str(store.folder), "--reranker",
                     str(tiny_reranker_checkpoint)) as server:
        page.goto(server.url)
        page.check("#search-rerank")  # shown once GET /v1/index names the reranker
        page.fill("#search-query", "a grey page")
        with page.expect_request("**/v1/search") as request:
            page.click("#search-button")
        assert json.loads(request.value.post_data)["rerank"] is True
        captions = page.locator("#search-results figcaption")
        expect(captions).to_have_count(6, timeout=60_000)  # every entry, the reranker's best first
        assert all(c.startswith("rerank ") for c in captions.all_inner_texts())
