"""The web page in headless Chromium (Debian's `chromium`, driven by Playwright's Python
package): upload an image, pick a preset, watch the answer stream, stop it, ask a follow-up;
the JSON switch with a schema.

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
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install -y chromium) so the web page cannot be driven")
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
