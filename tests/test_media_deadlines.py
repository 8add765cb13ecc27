"""Preparing a request (decoding images and videos, tokenizing) is bounded: a clip's decoding
work is capped (refused before decoding when its keyframes are too sparse for its samples),
preparation has a deadline, a client that leaves cancels its own, requests without media never
wait behind media, and a text too long for the context is refused before it is tokenized.

The hostile clips are one keyframe followed by thousands of copies of one tiny P-frame (no
motion, every macroblock skipped): a few hundred bytes a frame to send, a full frame to decode."""

from __future__ import annotations

import base64
import fractions
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from qvl.deadline import Cancelled, Deadline, DeadlineExceeded
from qvl.bench import synthetic_clip
from qvl.engine import Request, RequestError
from qvl.processing import video
from qvl.processing.image import ImageProcessorConfig
from qvl.processing.video import VideoError, VideoSettings, frames_to_decode, load_video
from qvl.sampling import SamplingParams
from qvl.server.settings import MB, ConnectionLimits
from tests.test_server_hardening import URL, live
from tests.test_server_support import image_message, png_bytes

CFG = ImageProcessorConfig(16, 2, 2, 65536, 16777216, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def hostile_clip(path, width: int, height: int, frames: int) -> bytes:
    """An H.264 MP4 of one keyframe and `frames - 1` repeats of one skipped P-frame, 30 fps."""
    import av

    encoder = av.CodecContext.create("libx264", "w")
    encoder.width, encoder.height, encoder.pix_fmt = width, height, "yuv420p"
    encoder.time_base = fractions.Fraction(1, 30)
    encoder.options = {"preset": "ultrafast", "bframes": "0", "g": "100000", "sc_threshold": "0"}
    black = np.zeros((height, width, 3), np.uint8)
    packets = []
    for i in range(2):
        frame = av.VideoFrame.from_ndarray(black, format="rgb24")
        frame.pts = i
        packets += encoder.encode(frame)
    packets += encoder.encode(None)
    key, skipped = bytes(packets[0]), bytes(packets[1])
    with av.open(str(path), "w") as out:
        stream = out.add_stream("h264", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.extradata = encoder.extradata
        for i in range(frames):
            packet = av.Packet(key if i == 0 else skipped)
            packet.pts = packet.dts = i
            packet.time_base, packet.stream = fractions.Fraction(1, 30), stream
            packet.is_keyframe = i == 0
            out.mux(packet)
    return path.read_bytes()


@pytest.fixture(scope="module")
def slow_clip(tmp_path_factory) -> bytes:
    """8,000 frames of 1080p that all must be decoded (within the decoding cap): 4-5 s on a Zen 4."""
    return hostile_clip(tmp_path_factory.mktemp("clips") / "slow.mp4", 1920, 1080, 8000)


def video_body(data: bytes) -> dict:
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}], "max_tokens": 1}


# -- decoding work and time ---------------------------------------------------------------------


def test_frames_to_decode_seeks_to_the_nearest_keyframe():
    assert frames_to_decode([0, 10, 20], [0]) == 21  # one keyframe: everything up to the last sample
    assert frames_to_decode([0, 10, 20], [0, 9, 18]) == 1 + 2 + 3
    assert frames_to_decode([5, 5, 6], [0]) == 7  # a repeated sample costs nothing more


def test_sparse_keyframes_are_refused_before_any_frame_is_decoded(tmp_path, tiny_engine):
    """One 4K keyframe, then 5,000 frames that each need the one before: 64 sampled frames
    need all of them, past the cap of 2,048 4K frames, and that is known from the packet
    headers alone."""
    data = hostile_clip(tmp_path / "sparse.mp4", 3840, 2160, 5000)
    started = time.monotonic()
    with pytest.raises(VideoError, match="keyframes are too far apart.* need 5000 frames of 3840x2160 decoded.* "
                                         "at most 2048 frames"):
        load_video(data, CFG)
    assert time.monotonic() - started < 5  # decoding them takes a minute
    with pytest.raises(RequestError) as caught:
        tiny_engine.parse(Request([{"role": "user", "content": [{"type": "video", "video": data}]}]))
    assert caught.value.param == "messages[0].content[0]" and caught.value.code == "invalid_video"


def test_decoding_stops_at_the_cap_when_seeking_would_not_be_used(tmp_path, monkeypatch):
    """Keyframes every 10 frames: the 64 sampled frames could be reached decoding a few hundred,
    so the clip passes the check before decoding; the decoder goes straight through (its
    samples are under a second apart), and decoding stops at the cap of packets sent to it."""
    path = synthetic_clip(tmp_path / "dense.mp4", 40, 96, 64, fps=25, keyframe_every=10)
    monkeypatch.setattr(video, "MAX_DECODED_PIXELS", 500 * 96 * 64)
    with pytest.raises(VideoError, match=r"stopped after 500 frames of 96x64, the most .* frames still to come"):
        load_video(path, CFG)


def test_decoding_stops_at_the_deadline_or_when_cancelled(slow_clip):
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="decoding the video took longer than the 0.5 s"):
        load_video(slow_clip, CFG, deadline=Deadline(0.5))
    assert time.monotonic() - started < 3
    cancelled = Deadline()
    cancelled.cancel()
    with pytest.raises(Cancelled):
        load_video(slow_clip, CFG, VideoSettings(), deadline=cancelled)


def test_an_engine_names_the_part_that_ran_out_of_time(tiny_engine, slow_clip):
    content = [{"type": "text", "text": "?"}, {"type": "video", "video": slow_clip}]
    with pytest.raises(RequestError, match="took longer than the 0.5 s") as caught:
        tiny_engine.parse(Request([{"role": "user", "content": content}]), Deadline(0.5))
    assert caught.value.param == "messages[0].content[1]" and caught.value.code == "timeout"


# -- text before tokenizing -----------------------------------------------------------------------


def test_text_over_the_context_is_refused_by_its_length(tiny_engine):
    """A token is at most 128 characters (a run of spaces): 25,600 spaces are ~200 tokens, so
    the bound is tight, and a prompt it lets through is tokenized and checked as before."""
    spaces = [{"role": "user", "content": " " * (128 * 200)}]
    context = tiny_engine.limits.max_context
    parsed = tiny_engine.parse(Request(spaces, SamplingParams(max_new_tokens=context - 230)))
    assert len(parsed.ids) <= 230
    with pytest.raises(RequestError, match=r"has 25,6\d\d characters of text: at least 20\d tokens.* leaves 150 "
                                           "for the prompt") as caught:
        tiny_engine.parse(Request(spaces, SamplingParams(max_new_tokens=context - 150)))
    assert caught.value.param == "messages[0]" and caught.value.code == "context_length_exceeded"


def test_an_18_mb_text_is_refused_at_once_naming_its_length(tiny_engine):
    from fastapi.testclient import TestClient

    from qvl.server.app import create_app
    from tests.test_server_hardening import LOCAL, make_settings, wait_ready

    huge = "lorem ipsum dolor sit amet " * (18 * MB // 27)
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": huge}],
            "max_tokens": 1}
    with TestClient(create_app(make_settings(max_body_bytes=20 * MB), lambda: tiny_engine), base_url=LOCAL) as client:
        wait_ready(client.get)
        started = time.monotonic()
        response = client.post(URL, content=json.dumps(body), headers={"Content-Type": "application/json"})
        elapsed = time.monotonic() - started
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
    chars = int(re.search(r"has ([\d,]+) characters of text", error["message"])[1].replace(",", ""))
    assert error["param"] == "messages[1]" and len(huge) < chars < len(huge) + 100
    assert elapsed < 8, elapsed  # tokenizing it takes ten seconds and more


# -- the server: lanes, deadline, clients that leave ----------------------------------------------


def post(url: str, body: dict, out: dict, key: str) -> None:
    started = time.monotonic()
    out[key] = httpx.post(url + URL, json=body, timeout=120)
    out[key + "_s"] = time.monotonic() - started


def test_text_is_answered_while_media_requests_are_being_prepared(tiny_engine, slow_clip):
    """Both media slots decode the slow clip until the preparation deadline (then 400 naming
    the part); a text request meanwhile is answered at once."""
    with live(tiny_engine, ConnectionLimits(), parse_timeout_s=3.0) as srv:
        out: dict = {}
        media = [threading.Thread(target=post, args=(srv.url, video_body(slow_clip), out, f"video{i}"))
                 for i in range(2)]
        for thread in media:
            thread.start()
        time.sleep(0.5)  # both in preparation
        post(srv.url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}, out, "text")
        assert out["text"].status_code == 200, out["text"].text
        assert out["text_s"] < 4, out["text_s"]
        assert not any(out.get(f"video{i}") for i in range(2)), "the media requests ended before the text one"
        for thread in media:
            thread.join(60)
        for i in range(2):
            error = out[f"video{i}"].json()["error"]
            assert out[f"video{i}"].status_code == 400 and error["code"] == "timeout", error
            assert error["param"] == "messages[0].content[0]" and "took longer than the 3 s" in error["message"]


def test_a_client_that_leaves_frees_its_slot(tiny_engine, slow_clip):
    """One media slot, taken by a slow clip whose client then hangs up: the next media request
    gets the slot within moments, not after the clip's many seconds of decoding."""
    with live(tiny_engine, ConnectionLimits(), parse_slots=1) as srv:
        body = json.dumps(video_body(slow_clip)).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        sock.sendall(f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.5)  # in preparation
        sock.close()
        started = time.monotonic()
        image = {"messages": [image_message("What color?", png_bytes())], "max_tokens": 2}
        answer = httpx.post(srv.url + URL, json=image, timeout=60)
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started < 4, time.monotonic() - started


def test_serve_takes_a_parse_timeout():
    from qvl.cli import build_parser
    from qvl.server.cli import settings

    parser, _ = build_parser()
    assert settings(parser.parse_args(["serve", "--parse-timeout", "7.5"])).parse_timeout_s == 7.5
    with pytest.raises(ValueError, match="parse timeout must be > 0"):
        settings(parser.parse_args(["serve", "--parse-timeout", "0"]))
