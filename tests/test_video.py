"""Video: frame sampling, timestamps and pixels against transformers' Qwen3VLVideoProcessor,
prompt ids and greedy tokens against its processor and `generate`, and bad clips refused
with a message naming the problem. Clips are written by the tests (qvl.bench.synthetic_clip)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from qvl.bench import synthetic_clip
from qvl.engine import Engine, EngineOptions, Request, RequestError
from qvl.processing.image import ImageProcessorConfig
from qvl.processing.video import (
    ClipInfo,
    VideoError,
    VideoSettings,
    frame_size,
    load_video,
    pair_timestamps,
    sample_indices,
)
from qvl.sampling import SamplingParams
from tests.reference import load_reference, reference_video_processor

CFG = ImageProcessorConfig(16, 2, 2, 65536, 16777216, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
MIN_PIXELS = 4096  # the shipped video_preprocessor_config's size.shortest_edge


def reference(settings: VideoSettings):
    """The reference processor set to qvl's settings: the token budget is its pixel budget
    over T x H x W (two frames per token of 32 x 32 pixels)."""
    return reference_video_processor(size={"shortest_edge": MIN_PIXELS, "longest_edge": settings.max_tokens * 2048},
                                     fps=settings.fps, max_frames=settings.max_frames, min_frames=settings.min_frames)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    return {
        "short": synthetic_clip(root / "short.mp4", 5, 320, 240, fps=10),  # 50 frames
        "odd": synthetic_clip(root / "odd.mp4", 2.3, 200, 120, fps=10),  # 23 frames: min_frames, odd pairs
        "wide": synthetic_clip(root / "wide.mp4", 4, 640, 360, fps=24),  # resized down by the budget
        "webm": synthetic_clip(root / "clip.webm", 3, 160, 96, fps=12, codec="libvpx-vp9"),  # no frame count in header
    }


def all_frames(path):
    """Every frame and the metadata, by transformers' PyAV reader; for a container whose header
    gives no frame count (which that reader cannot sample), by decoding them all with PyAV."""
    import av
    from transformers.video_utils import VideoMetadata
    from transformers.video_utils import load_video as reference_load_video

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return reference_load_video(str(path), backend="pyav")
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, VideoMetadata(total_num_frames=len(frames), fps=float(stream.average_rate),
                                     width=stream.width, height=stream.height, video_backend="pyav")


# -- the reference's arithmetic --------------------------------------------------------------


@pytest.mark.parametrize("total,video_fps", [(1, 30.0), (3, 24.0), (9, 10.0), (50, 10.0), (301, 29.97), (18000, 30.0)])
@pytest.mark.parametrize("fps,max_frames", [(2.0, 64), (0.5, 768), (1.0, 8), (3.0, 32)])
def test_sampling_and_timestamps_match_the_reference(total, video_fps, fps, max_frames):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    settings = VideoSettings(fps=fps, max_frames=max_frames)
    ref = reference(settings)
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    theirs = ref.sample_frames(meta, fps=fps)
    ours = sample_indices(total, video_fps, settings)
    assert ours.tolist() == theirs.tolist()
    reference_times = Qwen3VLProcessor._calculate_timestamps(None, theirs, video_fps, 2)
    assert pair_timestamps(ours.tolist(), video_fps, 2) == reference_times


@pytest.mark.parametrize("frames", [2, 4, 7, 64, 768])
@pytest.mark.parametrize("height,width", [(720, 1280), (1080, 1920), (240, 320), (20, 500), (4000, 90), (31, 31)])
@pytest.mark.parametrize("tokens", [64, 1024, 16384])
def test_frame_size_matches_the_reference(frames, height, width, tokens, monkeypatch):
    from tests import reference as shim_module

    settings = VideoSettings(max_tokens=tokens)
    ref = reference(settings)
    sizes = []
    monkeypatch.setattr(shim_module._TorchvisionShim, "resize",
                        staticmethod(lambda image, size, **_: sizes.append(tuple(size)) or image))

    videos = torch.zeros(1, 1, 3, 1, 1, dtype=torch.uint8).expand(1, frames, 3, height, width)  # no memory
    ref.resize(videos, ref.size, resample=ref.resample, factor=32, temporal_factor=2,
               cap_pixels_per_frame=True)
    assert frame_size(frames, height, width, CFG, tokens) == sizes[0]


@pytest.mark.parametrize("name,settings", [("short", VideoSettings()), ("odd", VideoSettings()),
                                           ("wide", VideoSettings(max_tokens=128)),
                                           ("wide", VideoSettings(fps=1.0, max_frames=6, max_tokens=300)),
                                           ("webm", VideoSettings(fps=3.0))])
def test_pixels_match_the_reference_processor(clips, name, settings):
    frames, meta = all_frames(clips[name])
    out = reference(settings)(videos=[frames], video_metadata=[meta], do_sample_frames=True, return_metadata=True,
                              cap_pixels_per_frame=True, return_tensors="pt")
    clip = load_video(clips[name], CFG, settings)
    assert clip.indices == out["video_metadata"][0].frames_indices.tolist()
    t, h, w = out["video_grid_thw"][0].tolist()
    assert len(clip.pairs) == t and all(p.grid_thw == (1, h, w) and p.video for p in clip.pairs)
    ours = torch.cat([p.pixel_values for p in clip.pairs])
    assert torch.equal(ours, out["pixel_values_videos"])


def test_a_long_clip_is_sampled_by_seeking_to_the_same_frames(tmp_path):
    """Gaps between sampled frames longer than a few seconds are skipped by seeking; the frames
    kept are the frames a full decode keeps."""
    path = synthetic_clip(tmp_path / "long.mp4", 40, 96, 64, fps=25)
    sparse = VideoSettings(fps=0.1, max_frames=8)  # one frame every ~5.6 s: seeks
    clip = load_video(path, CFG, sparse)
    frames, meta = all_frames(path)
    out = reference(sparse)(videos=[frames], video_metadata=[meta], do_sample_frames=True, return_metadata=True,
                            cap_pixels_per_frame=True, return_tensors="pt")
    assert torch.equal(torch.cat([p.pixel_values for p in clip.pairs]), out["pixel_values_videos"])


# -- prompt and greedy tokens against transformers ---------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="fp32", threads=2, max_image_tokens=64,
                                       video=VideoSettings(fps=2.0, max_frames=16, max_tokens=256)))
    return engine, load_reference(tiny_checkpoint)


def reference_processor(path, settings: VideoSettings, monkeypatch):
    """transformers' Qwen3VLProcessor (its class check skipped: without torchvision the video
    processor's auto class is a placeholder)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *_: None)

    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 65536}, patch_size=16,
                                      merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(str(path)),
                            video_processor=reference(settings),
                            chat_template=(path / "chat_template.jinja").read_text())


def noise_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.mark.parametrize("with_image", [False, True], ids=["clip", "clip+image"])
def test_greedy_tokens_match_transformers(pair, clips, tiny_checkpoint, with_image, monkeypatch):
    engine, ref = pair
    picture = noise_image(120, 200, 3)
    content = ([{"type": "image", "image": picture}, {"type": "text", "text": "Here is a photo, and a clip:"}]
               if with_image else []) + [{"type": "video", "video": str(clips["odd"])},
                                         {"type": "text", "text": "What happens in this clip?"}]
    messages = [{"role": "user", "content": content}]
    parsed = engine.parse(Request(messages, SamplingParams(temperature=0, max_new_tokens=24)))
    done = engine.generate(parsed)

    processor = reference_processor(tiny_checkpoint, engine.limits.video, monkeypatch)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames, meta = all_frames(clips["odd"])
    inputs = processor(text=[text], images=[picture] if with_image else None, videos=[frames], video_metadata=[meta],
                       return_tensors="pt", videos_kwargs={"do_sample_frames": True, "cap_pixels_per_frame": True})
    inputs.pop("video_metadata", None)
    assert inputs["input_ids"][0].tolist() == parsed.ids.tolist()
    with torch.inference_mode():
        out = ref.generate(**inputs, max_new_tokens=24, do_sample=False, repetition_penalty=1.0,
                           eos_token_id=list(engine.defaults.eos_token_ids), pad_token_id=151643)
    theirs = out[0, parsed.ids.shape[0]:].tolist()
    assert len(done.token_ids) >= 16
    assert done.token_ids == theirs


def test_follow_up_about_a_clip_reuses_the_decoded_clip_and_its_features(pair, clips):
    engine, _ = pair
    ask = lambda q: Request([{"role": "user", "content": [{"type": "video", "video": str(clips["short"])},  # noqa: E731
                                                          {"type": "text", "text": q}]}],
                            SamplingParams(temperature=0, max_new_tokens=4))
    engine.generate(ask("What moves?"))
    hits = engine.clips.stats.hits
    parsed = engine.parse(ask("What colour is the square?"))
    assert engine.clips.stats.hits == hits + 1  # not decoded again
    second = engine.generate(parsed)
    assert second.timings.cached["prefix"]  # the clip's tokens are not run again either
    assert second.timings.reused_tokens > parsed.video_tokens > 200


# -- bad clips ---------------------------------------------------------------------------------


def fourcc_swapped(path) -> bytes:
    """An AVI whose codec tag names no codec this build knows."""
    data = path.read_bytes()
    return data.replace(b"FMP4", b"QQQQ")


@pytest.fixture(scope="module")
def bad_clips(clips, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    good = clips["short"].read_bytes()
    avi = synthetic_clip(root / "clip.avi", 1, 64, 48, fps=10, codec="mpeg4")
    empty = root / "empty.mp4"
    import av

    with av.open(str(empty), "w") as out:  # a header, no frame
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height = 64, 48
        out.start_encoding()
    fast, huge = root / "fast.mkv", root / "huge.mkv"
    for path, codec, rate, (width, height), pix_fmt in ((fast, "mpeg4", 5000, (64, 48), "yuv420p"),
                                                         (huge, "mjpeg", 1, (8704, 4400), "yuvj420p")):
        with av.open(str(path), "w") as out:  # an absurd frame rate; frames above 8K
            stream = out.add_stream(codec, rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
            for packet in [*stream.encode(frame), *stream.encode()]:
                out.mux(packet)
    return {
        "absurd fps": (fast.read_bytes(), "declares 5000 frames per second"),
        "absurd size": (huge.read_bytes(), "frames of 8704x4400 exceed the limit"),
        "corrupt": (b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 64, "not a readable video"),
        "truncated": (good[: len(good) // 3], "video"),
        "zero frames": (empty.read_bytes(), "no (video stream|frames)"),
        "unknown codec": (fourcc_swapped(avi), "codec"),
    }


@pytest.mark.parametrize("case", ["corrupt", "truncated", "zero frames", "unknown codec", "absurd fps", "absurd size"])
def test_bad_clips_are_refused_by_name_and_the_engine_keeps_serving(pair, bad_clips, clips, case):
    engine, _ = pair
    data, words = bad_clips[case]
    request = Request([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                    {"type": "video", "video": data}]}])
    with pytest.raises(RequestError) as caught:
        engine.parse(request)
    assert caught.value.code == "invalid_video" and caught.value.param == "messages[0].content[1]"
    assert re.search(words, str(caught.value))
    ok = engine.generate(Request([{"role": "user", "content": [{"type": "video", "video": str(clips["odd"])}]}],
                                 SamplingParams(temperature=0, max_new_tokens=2)))
    assert ok.usage.completion_tokens == 2


def test_absurd_rates_sizes_and_lengths_are_refused():
    info = ClipInfo(total_frames=10, fps=30.0, width=20000, height=20000, codec="h264")
    assert info.seconds == pytest.approx(1 / 3)
    with pytest.raises(VideoError, match="aspect ratio"):
        frame_size(4, 10, 4000, CFG, 256)
    with pytest.raises(ValueError, match="fps"):
        VideoSettings(fps=0)
    with pytest.raises(ValueError, match="fps"):
        VideoSettings(fps=float("nan"))
    with pytest.raises(ValueError, match="frames"):
        VideoSettings(max_frames=1)


def test_server_caps_on_length_budget_and_count(tiny_checkpoint, clips):
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, max_video_seconds=3,
                                       video=VideoSettings(max_tokens=256), video_tokens_cap=512, max_videos=1))
    video = {"type": "video", "video": str(clips["short"])}
    with pytest.raises(RequestError, match="lasts 5.0 s.*at most 3 s"):
        engine.parse(Request([{"role": "user", "content": [video]}]))
    short = {"type": "video", "video": str(clips["odd"])}
    with pytest.raises(RequestError, match="over this server's cap of 512"):
        engine.parse(Request([{"role": "user", "content": [short]}], video={"max_tokens": 1024}))
    with pytest.raises(RequestError, match="too many videos"):
        engine.parse(Request([{"role": "user", "content": [short, short]}]))
    with pytest.raises(RequestError, match="fps"):
        engine.parse(Request([{"role": "user", "content": [short]}], video={"fps": 500}))
    parsed = engine.parse(Request([{"role": "user", "content": [short]}], video={"fps": 1, "max_tokens": 64}))
    assert sum(u.num_tokens for u in parsed.images) <= 64


# -- front doors: the API, qvl ask, qvl batch ----------------------------------------------------


@pytest.fixture(scope="module")
def api(pair):
    from fastapi.testclient import TestClient
    from tests.test_server_api import make_app, wait_ready

    with TestClient(make_app(pair[0])) as client:
        wait_ready(client)
        yield client


def video_part(data: bytes) -> dict:
    import base64

    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def test_api_takes_a_video_url_with_its_own_settings(api, clips):
    body = {"messages": [{"role": "user", "content": [video_part(clips["short"].read_bytes()),
                                                      {"type": "text", "text": "What moves?"}]}],
            "max_tokens": 3, "temperature": 0}
    answer = api.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["qvl"]["video_tokens"] == 240 and answer.json()["qvl"]["image_tokens"] == 0
    fewer = api.post("/v1/chat/completions", json={**body, "fps": 0.5, "max_video_tokens": 64}).json()
    assert 0 < fewer["qvl"]["video_tokens"] <= 64


@pytest.mark.parametrize("change,status,param", [
    ({"fps": 0}, 400, None), ({"fps": 120}, 400, None), ({"max_frames": 1}, 400, None),
    ({"max_video_tokens": 10**6}, 400, "max_video_tokens"), ({"max_frames": 10**4}, 400, "max_frames"),
])
def test_api_refuses_bad_video_settings(api, clips, change, status, param):
    from tests.test_server_api import assert_error

    body = {"messages": [{"role": "user", "content": [video_part(clips["odd"].read_bytes())]}], "max_tokens": 1,
            **change}
    assert_error(api.post("/v1/chat/completions", json=body), status, param)


def test_api_refuses_a_corrupt_video_by_its_part_and_keeps_serving(api, bad_clips, clips):
    from tests.test_server_api import assert_error

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "?"},
                                                      video_part(bad_clips["corrupt"][0])]}], "max_tokens": 1}
    error = assert_error(api.post("/v1/chat/completions", json=body), 400,
                         "messages[0].content[1].video_url.url", "invalid_video")
    assert "not a readable video" in error["message"]
    many = {"messages": [{"role": "user", "content": [video_part(b"x")] * 3}], "max_tokens": 1}
    assert_error(api.post("/v1/chat/completions", json=many), 400, "messages", "too_many_videos")
    ok = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        video_part(clips["odd"].read_bytes())]}], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_qvl_ask_with_a_clip_and_an_image(tiny_checkpoint, clips, tmp_path, capsys):
    import json

    from qvl.cli import main

    picture = tmp_path / "p.png"
    noise_image(64, 96, 0).save(picture)
    code = main(["ask", "-v", str(clips["odd"]), "-i", str(picture), "What happens?", "--model", str(tiny_checkpoint),
                 "--weights", "fp32", "--threads", "2", "--max-new-tokens", "3", "--json", "--fps", "1",
                 "--max-video-tokens", "128"])
    assert code == 0
    usage = json.loads(capsys.readouterr().out)["usage"]
    assert 0 < usage["video_tokens"] <= 128 and usage["image_tokens"] > 0
    code = main(["ask", "-v", str(tmp_path / "missing.mp4"), "?", "--model", str(tiny_checkpoint)])
    assert code != 0 and "video file not found" in capsys.readouterr().err


def test_qvl_batch_over_videos_and_images(tiny_checkpoint, clips, bad_clips, tmp_path):
    import json
    import subprocess
    import sys

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.mp4").write_bytes(clips["odd"].read_bytes())
    (folder / "b.webm").write_bytes(clips["webm"].read_bytes())
    (folder / "broken.mp4").write_bytes(bad_clips["corrupt"][0])
    noise_image(48, 64, 1).save(folder / "c.png")
    out = tmp_path / "rows.jsonl"
    run = subprocess.run([sys.executable, "-m", "qvl.cli", "batch", str(folder), "--out", str(out), "-p", "Describe.",
                          "--model", str(tiny_checkpoint), "--dtype", "fp32", "--threads", "1",
                          "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr  # one item failed
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"a.mp4", "b.webm", "broken.mp4", "c.png"}
    assert rows["a.mp4"]["video"] == str(folder / "a.mp4") and rows["a.mp4"]["usage"]["video_tokens"] > 0
    assert rows["b.webm"]["usage"]["video_tokens"] > 0 and rows["c.png"]["usage"]["image_tokens"] > 0
    assert "image" in rows["c.png"] and "video" not in rows["c.png"]
    assert "not a readable video" in rows["broken.mp4"]["error"]


@pytest.mark.parametrize("playlist", ["ffconcat version 1.0\nfile {path}\n", "#EXTM3U\n#EXTINF:5,\n{path}\n"])
def test_a_playlist_posing_as_a_video_reads_no_other_file(pair, clips, tmp_path, monkeypatch, playlist):
    """FFmpeg's concat and HLS demuxers open the files a playlist names: a "video" sent to the
    server must not show the model a file of the server's disk."""
    engine, _ = pair
    monkeypatch.chdir(clips["short"].parent)
    for path in (clips["short"].name, str(clips["short"])):
        data = playlist.format(path=path).encode()
        with pytest.raises(RequestError, match="not a readable video") as caught:
            engine.parse(Request([{"role": "user", "content": [{"type": "video", "video": data}]}]))
        assert caught.value.code == "invalid_video"


def test_seeking_never_decodes_more_frames_than_the_clip_has(tmp_path, monkeypatch):
    """Sparse sampling over sparse keyframes: a seek to the keyframe before a target may land
    before where decoding already was; then seeking stops instead of decoding frames again."""
    import av

    path = synthetic_clip(tmp_path / "sparse.mp4", 60, 96, 64, fps=25, keyframe_every=1500)  # one keyframe
    decoded, real_open = [], av.open

    class Counting:
        def __init__(self, container):
            self.container = container

        def __getattr__(self, name):
            return getattr(self.container, name)

        def demux(self, *args, **kwargs):  # every packet read is sent to the decoder
            for packet in self.container.demux(*args, **kwargs):
                if packet.size:
                    decoded.append(packet.pts)
                yield packet

    monkeypatch.setattr(av, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    clip = load_video(path, CFG, VideoSettings(fps=0.15, max_frames=9))
    assert len(clip.indices) == 9 and clip.info.total_frames == 1500
    # one wasted seek at most: back to the only keyframe, then straight on
    assert len(decoded) <= 1500 + clip.indices[1], f"{len(decoded)} frames decoded for a 1500-frame clip"
