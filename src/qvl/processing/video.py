"""Video decoding and Qwen3-VL video preprocessing: stream-decode -> sample -> resize -> frame pairs.

Follows transformers' `Qwen3VLVideoProcessor` with the PyAV reader: `fps` frames per second
between `min_frames` and `max_frames` at evenly spaced (rounded) indices, one size for all
frames from the video `smart_resize` (the pixel budget counts every frame, each frame's share
capped at 768 tokens as qwen-vl-utils does), bicubic antialiased resize of uint8 frames,
`(x - 255 mean) / (255 std)` in float32, frames paired into temporal patches (the last frame
repeated when the count is odd). Each pair is one unit for the vision tower and the prompt:
`<{t:.1f} seconds><|vision_start|><|video_pad|>...<|vision_end|>`, t the mean time of the pair.

Frames are decoded as a stream and only the sampled ones are kept, already resized: a
10-minute clip costs the memory of its sampled frames, not of its frames. Decoding is bounded
in work (MAX_DECODED_PIXELS: a clip whose keyframes are too sparse for its samples is refused
before anything is decoded, and decoding stops there in any case) and in time (a Deadline,
checked at every packet).
"""

from __future__ import annotations

import bisect
import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qvl.deadline import Deadline
from qvl.processing.image import (
    MAX_ASPECT_RATIO,
    ImageError,
    ImageProcessorConfig,
    ProcessedImage,
    content_hash,
)

DEFAULT_FPS = 2.0
DEFAULT_MAX_FRAMES = 64  # CPU defaults: docs/decisions/image-budget.md (video)
DEFAULT_MAX_VIDEO_TOKENS = 1024
MIN_FRAMES = 4  # the reference's min_frames
FRAME_TOKEN_CAP = 768  # tokens of one frame at most (qwen-vl-utils' VIDEO_MAX_TOKEN_NUM)
VIDEO_TOKENS_CAP = 16384  # the largest clip budget a request may ask for, unless the server says otherwise
VIDEO_FRAMES_CAP = 768  # the most frames a request may ask for (the reference's max_frames)
MAX_VIDEOS = 2  # clips per request
MIN_PIXELS = 4096  # the shipped video_preprocessor_config's size.shortest_edge (over T x H x W)
MAX_FRAME_PIXELS = 8192 * 4320  # frames above 8K are refused before decoding
MAX_FPS = 1000.0
FALLBACK_FPS = 24.0  # what the reference assumes when a file declares no frame rate
SEEK_SECONDS = 4.0  # a gap longer than this between sampled frames is skipped by seeking
MAX_DECODED_PIXELS = 8192 * 1920 * 1080  # decoding work per clip: 8,192 frames of 1080p, 512 of 8K
# The containers FFmpeg may open: never its playlist and concat demuxers, which read other files
# (a "video" of `ffconcat ... file secret.mp4` would show the model a file of the server's disk).
CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,mpeg,flv,asf,ogg"
CONTAINER_NAMES = "MP4/MOV, Matroska/WebM, AVI, MPEG-TS/PS, FLV, ASF/WMV, Ogg"


class VideoError(ImageError):
    """Input that is not a usable video; the message names the problem."""


@dataclass(frozen=True)
class VideoSettings:
    """How a clip becomes tokens: sampling rate, frame cap and the token budget of the whole clip."""

    fps: float = DEFAULT_FPS
    max_frames: int = DEFAULT_MAX_FRAMES
    max_tokens: int = DEFAULT_MAX_VIDEO_TOKENS
    min_frames: int = MIN_FRAMES

    def __post_init__(self) -> None:
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and 0 < self.fps <= 60):
            raise ValueError(f"video fps must be in (0, 60], got {self.fps!r}")
        if not isinstance(self.max_frames, int) or self.max_frames < 2:
            raise ValueError(f"max video frames must be an integer >= 2, got {self.max_frames!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max video tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_frames, int) or self.min_frames < 1:  # max_frames wins over it
            raise ValueError(f"min video frames must be a positive integer, got {self.min_frames!r}")


@dataclass(frozen=True)
class ClipInfo:
    """What the container says about its first video stream."""

    total_frames: int
    fps: float
    width: int
    height: int
    codec: str

    @property
    def seconds(self) -> float:
        return self.total_frames / self.fps


@dataclass(frozen=True, eq=False)
class ProcessedVideo:
    """A clip ready for the prompt: one unit per frame pair, each with its time in seconds."""

    pairs: list[ProcessedImage]  # pixels [2, h, w, 3] uint8, video=True
    timestamps: list[float]  # mean time of each pair's two frames
    indices: list[int]  # the sampled frame indices (before pairing)
    info: ClipInfo

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.pairs)

    def layout(self) -> list[tuple[float, int]]:
        """(seconds, tokens) per pair: what the prompt writes for this clip."""
        return [(t, p.num_tokens) for t, p in zip(self.timestamps, self.pairs)]


# ---------------------------------------------------------------------------------------------
# The reference's arithmetic


def sample_indices(total_frames: int, video_fps: float, settings: VideoSettings) -> np.ndarray:
    """Frame indices to keep: `settings.fps` per second of clip, clamped to
    [min_frames, max_frames] and to the frames there are, evenly spaced and rounded."""
    n = int(total_frames / video_fps * settings.fps)
    n = min(max(n, settings.min_frames), settings.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int)


def frame_size(num_frames: int, height: int, width: int, cfg: ImageProcessorConfig,
               max_tokens: int) -> tuple[int, int]:
    """(height, width) of every frame: multiples of cfg.factor with the clip's pixels
    (counted over all `num_frames`) within `max_tokens` tokens, each frame at most
    FRAME_TOKEN_CAP tokens. The video smart_resize of the reference."""
    factor, temporal = cfg.factor, cfg.temporal_patch_size
    num_frames = max(num_frames, temporal)  # a one-frame clip is sized as the pair it becomes
    budget = max_tokens * factor * factor * temporal  # pixels over T x H x W
    per_frame = max(min(FRAME_TOKEN_CAP * factor * factor, budget // num_frames), int(MIN_PIXELS * 1.05))
    max_pixels = per_frame * num_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(f"video aspect ratio {max(height, width) / min(height, width):.1f} ({width}x{height}) "
                         f"exceeds the maximum of {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pair_timestamps(indices: list[int], video_fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame (the last
    index repeated to fill the final patch)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    times = [i / video_fps for i in padded]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


def resize_frame(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[H, W, 3] uint8 -> [h, w, 3] uint8, bicubic with antialiasing on the uint8 values
    (what torchvision's resize runs for the reference)."""
    if rgb.shape[:2] == size:
        return rgb
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]  # [1, 3, H, W]
    y = torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0).contiguous().numpy()


# ---------------------------------------------------------------------------------------------
# Decoding


def _open(source: bytes | str | os.PathLike):
    import av  # imported here: a start without video pays nothing for it

    if isinstance(source, (bytes, bytearray, memoryview)):
        fp, where = io.BytesIO(bytes(source)), ""
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise VideoError(f"video file not found: {path}")
        fp, where = str(path), f" ({path})"
    else:
        raise VideoError(f"unsupported video source type: {type(source).__name__}")
    try:
        container = av.open(fp, mode="r", metadata_errors="ignore", options={"format_whitelist": CONTAINERS})
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError) as e:
        raise VideoError(f"not a readable video{where} (containers read: {CONTAINER_NAMES}): {_reason(e)}") from None
    return container, where


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def probe(container, where: str, deadline: Deadline) -> ClipInfo:
    """The first video stream's frame count, rate, size and codec (from the headers; the
    frames are counted from the packets when the container does not say). `where` names the
    file in messages (" (path)", or "")."""
    if not container.streams.video:
        raise VideoError(f"no video stream in the file{where}")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    if ctx is None or ctx.codec is None or not getattr(ctx.codec, "is_decoder", True):
        raise VideoError(f"the video's codec cannot be decoded by this build{where}")
    width, height = ctx.width, ctx.height
    if width <= 0 or height <= 0:
        raise VideoError(f"the video has no frame size ({width}x{height}){where}")
    if width * height > MAX_FRAME_PIXELS:
        raise VideoError(f"video frames of {width}x{height} exceed the limit of {MAX_FRAME_PIXELS} pixels")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else FALLBACK_FPS
    if not (math.isfinite(fps) and 0 < fps <= MAX_FPS):
        raise VideoError(f"the video declares {fps:g} frames per second (at most {MAX_FPS:g} are accepted){where}")
    total = stream.frames
    if total <= 0:  # not in the header (Matroska, WebM, ...): count the packets, nothing is decoded
        total = sum(1 for _ in scan_packets(container, where, deadline))
    if total <= 0:
        raise VideoError(f"the video has no frames{where}")
    return ClipInfo(int(total), fps, width, height, ctx.codec.name)


def _timing(stream) -> tuple[int, float]:
    """(start pts, seconds per pts unit: 0 when the stream has no time base)."""
    return stream.start_time or 0, float(stream.time_base) if stream.time_base else 0.0


def _frame_at(pts: int, base: int, tb: float, fps: float) -> int:
    return max(0, round((pts - base) * tb * fps))


def scan_packets(container, where: str, deadline: Deadline) -> Iterator[tuple[int | None, bool]]:
    """(pts, keyframe) of each packet of the first video stream that carries data, from the
    headers (nothing is decoded); the container is rewound after the last."""
    import av

    stream = container.streams.video[0]
    try:
        for packet in container.demux(stream):
            deadline.check(f"reading the video's packets{where}")
            if packet.size:
                yield packet.pts, packet.is_keyframe
        container.seek(0)
    except (av.FFmpegError, OSError) as e:
        raise VideoError(f"could not read the video's packets{where}: {_reason(e)}") from None


def frames_to_decode(indices: list[int], keyframes: list[int]) -> int:
    """The fewest frames a decoder must decode to reach every index of `indices` (ascending),
    each from the one before or by seeking to the last keyframe at or before it, whichever is
    nearer. `keyframes`: frame indices, ascending."""
    total, at = 0, -1  # the last frame decoded
    for i in indices:
        if i <= at:
            continue
        before = bisect.bisect_right(keyframes, i) - 1
        total += i - max(at + 1, keyframes[before] if before >= 0 else 0) + 1
        at = i
    return total


def most_decoded(pixels: int) -> int:
    """Frames of `pixels` pixels each that decoding one clip may take (MAX_DECODED_PIXELS)."""
    return MAX_DECODED_PIXELS // max(pixels, 1)


def check_decoding_work(container, where: str, info: ClipInfo, indices: list[int], deadline: Deadline) -> None:
    """Refuse, before decoding anything, a clip whose sampled frames need more decoding than
    MAX_DECODED_PIXELS even with every gap skipped by seeking (one keyframe, then thousands of
    8K frames). The keyframes are read from the packet headers, only when the whole clip is
    over that budget; per sampled frame only the last keyframe before it is kept."""
    most = most_decoded(info.width * info.height)
    if info.total_frames <= most:
        return
    base, tb = _timing(container.streams.video[0])
    nearest: dict[int, int] = {}  # position in indices -> the last keyframe at or before that sampled frame
    for n, (pts, key) in enumerate(scan_packets(container, where, deadline)):
        if key:
            frame = n if pts is None or not tb else _frame_at(pts, base, tb, info.fps)
            slot = bisect.bisect_left(indices, frame)
            if slot < len(indices):
                nearest[slot] = max(frame, nearest.get(slot, frame))
    needed = frames_to_decode(indices, sorted(nearest.values()))
    if needed > most:
        raise VideoError(f"the video's keyframes are too far apart{where}: its {len(indices)} sampled frames need "
                         f"{needed} frames of {info.width}x{info.height} decoded, and this server decodes at most "
                         f"{most} frames of that size per clip (re-encode it with a keyframe every few seconds)")


def decode_frames(container, where: str, info: ClipInfo, indices: list[int], size: tuple[int, int],
                  deadline: Deadline) -> list[np.ndarray]:
    """The frames at `indices` (ascending), each resized to `size` as soon as it is decoded.
    Long gaps are skipped by seeking to the keyframe before the next wanted frame. Each packet
    sent to the decoder checks `deadline` and counts against MAX_DECODED_PIXELS, at the
    largest frame size seen."""
    import av

    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    base, tb = _timing(stream)
    out: list[np.ndarray] = []
    k, count, sought = 0, -1, -1  # next wanted position in `indices`; index of the last decoded frame; last seek
    decoded, largest = 0, (info.width, info.height)  # packets sent to the decoder; the largest frame so far

    def index_of(frame) -> int:
        nonlocal count
        count = count + 1 if frame.pts is None or not tb else _frame_at(frame.pts, base, tb, info.fps)
        return count

    def frames_from(seek_to: int | None):
        nonlocal decoded
        if seek_to is not None and tb:
            container.seek(base + int(seek_to / info.fps / tb), stream=stream, backward=True, any_frame=False)
        for packet in container.demux(stream):
            deadline.check(f"decoding the video{where}")
            decoded += 1
            if decoded > most_decoded(largest[0] * largest[1]):
                raise VideoError(f"decoding the video{where} stopped after {decoded - 1} frames of "
                                 f"{largest[0]}x{largest[1]}, the most this server decodes per clip at that size, "
                                 f"with {len(indices) - k} of its {len(indices)} sampled frames still to come (sample "
                                 "fewer frames, or re-encode it with a keyframe every few seconds)")
            yield from packet.decode()

    seeking, before_seek = True, -1  # a seek that lands at or before where it left is not worth another

    try:
        decoder = frames_from(None)
        while k < len(indices):
            try:
                frame = next(decoder)
            except StopIteration:
                break
            if frame.width * frame.height > MAX_FRAME_PIXELS:  # a stream may change size after its header
                raise VideoError(f"video frames of {frame.width}x{frame.height} exceed the limit of "
                                 f"{MAX_FRAME_PIXELS} pixels{where}")
            if frame.width * frame.height > largest[0] * largest[1]:
                largest = (frame.width, frame.height)
            at = index_of(frame)
            if before_seek >= 0:
                seeking, before_seek = at > before_seek, -1  # the keyframes are too sparse to gain by seeking
            while k < len(indices) and indices[k] <= at:
                if k and indices[k] == indices[k - 1]:  # sampled twice (a clip shorter than min_frames)
                    out.append(out[-1])
                else:
                    out.append(resize_frame(frame.to_ndarray(format="rgb24"), size))
                k += 1
            if seeking and k < len(indices) and (indices[k] - at) / info.fps > SEEK_SECONDS and indices[k] != sought:
                sought, before_seek = indices[k], at  # once per target: the keyframe may be further back still
                decoder = frames_from(sought)
    except av.FFmpegError as e:
        if not out:
            raise VideoError(f"could not decode the video{where}: {_reason(e)}") from None
        raise VideoError(f"could not decode the video{where} after {len(out)} of {len(indices)} sampled "
                         f"frames (truncated or corrupt?): {_reason(e)}") from None
    if not out:
        raise VideoError(f"no frame of the video could be decoded{where}")
    missing = len(indices) - len(out)
    if missing > max(1, len(indices) // 50):  # a frame or two short is a header that rounds; more is a cut file
        raise VideoError(f"the video{where} ends early: its header promises {info.total_frames} frames but only "
                         f"{len(out)} of {len(indices)} sampled frames were found (truncated?)")
    return out + [out[-1]] * missing


def load_video(source: bytes | str | os.PathLike, cfg: ImageProcessorConfig, settings: VideoSettings = VideoSettings(),
               *, max_seconds: float | None = None, deadline: Deadline | None = None) -> ProcessedVideo:
    """Decode, sample and preprocess one clip; raises VideoError naming what is wrong, and
    `deadline`'s Cancelled / DeadlineExceeded between packets."""
    deadline = deadline or Deadline()
    container, where = _open(source)
    try:
        info = probe(container, where, deadline)
        if max_seconds is not None and info.seconds > max_seconds:
            raise VideoError(f"the video lasts {info.seconds:.1f} s; this server takes clips of at most "
                             f"{max_seconds:g} s")
        indices = sample_indices(info.total_frames, info.fps, settings).tolist()
        size = frame_size(len(indices), info.height, info.width, cfg, settings.max_tokens)
        check_decoding_work(container, where, info, indices, deadline)
        frames = decode_frames(container, where, info, indices, size, deadline)
    finally:
        container.close()
    return preprocess_frames(frames, indices, info, cfg)


def preprocess_frames(frames: list[np.ndarray], indices: list[int], info: ClipInfo,
                      cfg: ImageProcessorConfig) -> ProcessedVideo:
    """Resized frames [h, w, 3] uint8 -> frame pairs for the vision tower, with their times."""
    t = cfg.temporal_patch_size
    frames = frames + [frames[-1]] * (-len(frames) % t)
    h, w = frames[0].shape[:2]
    grid = (1, h // cfg.patch_size, w // cfg.patch_size)
    pairs = []
    for i in range(0, len(frames), t):
        pixels = np.stack(frames[i:i + t])  # [t, h, w, 3]
        pairs.append(ProcessedImage(pixels=pixels, cfg=cfg, grid_thw=grid,
                                    num_tokens=grid[1] * grid[2] // cfg.merge_size**2,
                                    content_hash=content_hash(pixels, cfg, video=True), size=(h, w), video=True))
    return ProcessedVideo(pairs, pair_timestamps(indices, info.fps, t), indices, info)
