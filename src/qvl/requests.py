"""Chat requests: what a front door hands the engine, and its checked, tokenized form."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, replace

import torch

from qvl.cache import LRU
from qvl.deadline import Deadline, DeadlineExceeded
from qvl.processing.image import (
    ImageError,
    ImageProcessorConfig,
    ProcessedImage,
    load_image,
    max_pixels_for_tokens,
    preprocess,
)
from qvl.processing.pdf import is_pdf, render_pages, split_pages
from qvl.processing.prompt import PromptTooLong, tokenize_chat
from qvl.processing.video import (
    MAX_VIDEOS,
    VIDEO_FRAMES_CAP,
    VIDEO_TOKENS_CAP,
    ProcessedVideo,
    VideoError,
    VideoSettings,
    load_video,
)
from qvl.processing.tokenizer import Tokenizer
from qvl.sampling import SamplingParams


class RequestError(ValueError):
    """A request qvl cannot serve as given; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Request:
    """messages: [{"role", "content": str | [{"type": "text", "text"} | {"type": "image",
    "image": path | bytes | PIL.Image, "pages"?} | {"type": "video", "video": path | bytes}]}]
    (an image may be a PDF, "doc.pdf#pages=2-4" or bytes: each page an image; assistant
    messages may carry "tool_calls", and "tool" messages answer them, as the chat template
    renders them); max_image_tokens overrides the engine budget, video the engine's video
    settings (fps, frames, tokens; within the caps); tools (OpenAI function tools) go into
    the prompt."""

    messages: list[dict]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_image_tokens: int | None = None
    tools: list[dict] | None = None
    video: dict | None = None  # {"fps", "max_frames", "max_tokens"}: any of them, over the engine's
    cache_salt: str = ""  # cached work (answers, prompt prefixes, image features, clips) is shared only
    # between requests of the same salt
    template_kwargs: dict = field(default_factory=dict)  # more chat template variables: {"enable_thinking": False}
    # switches a hybrid template's thinking off (see check_template_kwargs)


@dataclass
class ParsedRequest:
    """A request checked and tokenized; images decoded and preprocessed, not yet encoded."""

    ids: torch.Tensor  # [T] long, image and video placeholders expanded
    images: list[ProcessedImage]  # vision units in prompt order: images and videos' frame pairs
    sampling: SamplingParams
    answer_checked: bool = False  # the answer cache was already asked (and missed)
    reasoning: bool = False  # the prompt opened `<think>`: the answer starts with reasoning
    cache_salt: str = ""  # the request's cache namespace (Request.cache_salt)
    last_hidden: bool = False  # ends after its prefill, answered with the last token's hidden state
    # (embeddings, reranking): no decoding

    @property
    def vision_tokens(self) -> int:
        """Placeholder tokens the vision tower fills: images' and video frame pairs'."""
        return sum(im.num_tokens for im in self.images)

    @property
    def image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images if not im.video)

    @property
    def video_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images if im.video)

    @property
    def last_image_size(self) -> tuple[int, int] | None:
        """(width, height) of the last still image as shown: the pixels grounding answers are in."""
        stills = [u for u in self.images if not u.video]
        return stills[-1].shown_size if stills else None

    @property
    def image_hashes(self) -> list[str]:
        return [im.content_hash for im in self.images]


@dataclass(frozen=True)
class Limits:
    max_image_tokens: int  # default budget per image
    image_tokens_cap: int  # the most a request may ask for
    max_images: int
    max_context: int
    video: VideoSettings = VideoSettings()  # defaults per clip
    video_tokens_cap: int = VIDEO_TOKENS_CAP  # the most a request may ask for, per clip
    video_frames_cap: int = VIDEO_FRAMES_CAP
    max_videos: int = MAX_VIDEOS
    max_video_seconds: float | None = None  # longer clips are refused (None: any length)


class ClipCache(LRU):
    """Decoded and preprocessed clips by file content and settings: a follow-up question
    about a clip skips decoding, and its frame pairs then hit the vision cache."""

    def __init__(self, max_mb: float):
        super().__init__(max_bytes=int(max_mb * 2**20))

    @staticmethod
    def key(source, settings: VideoSettings, cfg: ImageProcessorConfig, salt: str) -> str | None:
        if isinstance(source, (bytes, bytearray, memoryview)):
            digest = hashlib.sha256(source)
        elif isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
            with open(source, "rb") as f:
                digest = hashlib.file_digest(f, "sha256")
        else:
            return None
        digest.update(repr((settings, cfg, salt)).encode())
        return digest.hexdigest()

    def load(self, source, cfg: ImageProcessorConfig, settings: VideoSettings,
             max_seconds: float | None, deadline: Deadline, salt: str) -> ProcessedVideo:
        key = self.key(source, settings, cfg, salt) if self.enabled else None
        clip = self.get(key) if key else None
        if clip is None:  # (an engine's length cap is fixed: a kept clip passed it)
            clip = load_video(source, cfg, settings, max_seconds=max_seconds, deadline=deadline)
            if key:
                self.put(key, clip, sum(p.pixels.nbytes for p in clip.pairs))
        return clip


VIDEO_PARAMS = {"fps": "fps", "max_frames": "max_frames", "max_tokens": "max_video_tokens"}  # -> API field


def video_settings(request: Request, limits: Limits) -> VideoSettings:
    """The engine's video settings with the request's overrides, checked against the caps."""
    over = {k: v for k, v in (request.video or {}).items() if v is not None}
    settings = limits.video
    for key, value in over.items():  # one at a time, so an error names its field
        param = VIDEO_PARAMS.get(key)
        if param is None:
            raise RequestError(f"unknown video setting '{key}' (choose from {', '.join(VIDEO_PARAMS)})", "video")
        try:
            settings = replace(settings, **{key: value})
        except (ValueError, TypeError) as exc:
            raise RequestError(str(exc), param) from None
    if settings.max_tokens > limits.video_tokens_cap:
        raise RequestError(f"a video budget of {settings.max_tokens} tokens is over this server's cap of "
                           f"{limits.video_tokens_cap} tokens", VIDEO_PARAMS["max_tokens"])
    if settings.max_frames > limits.video_frames_cap:
        raise RequestError(f"{settings.max_frames} video frames are over this server's cap of "
                           f"{limits.video_frames_cap} frames", VIDEO_PARAMS["max_frames"])
    return settings


def pictures_of(part: dict, max_pixels: int, room: int) -> list:
    """An image part's pictures: the image itself, or a PDF's pages (all, or those of a
    `#pages=` fragment or the part's "pages"), rasterised for `max_pixels`; more than `room`
    pages is an error, found before any page is drawn."""
    source = part["image"]
    if not is_pdf(source):
        return [load_image(source)]
    pages = part.get("pages")
    if isinstance(source, (str, os.PathLike)):
        source, fragment = split_pages(str(source))
        pages = pages or fragment
    return render_pages(source, pages, max_pixels=max_pixels, max_pages=max(room, 0))


def _decode_media(request: Request, image_cfg: ImageProcessorConfig, limits: Limits, clips: ClipCache | None,
                  deadline: Deadline):
    """Template-ready messages (image and video parts reduced to {"type": ...}), the vision
    units in prompt order (images, and each video's frame pairs) and each video's layout.
    `deadline` is checked after each part (and between a video's packets)."""
    tokens = request.max_image_tokens or limits.max_image_tokens
    if tokens < 1:
        raise RequestError("max_image_tokens must be >= 1", "max_image_tokens")
    max_pixels = max_pixels_for_tokens(tokens, image_cfg)
    if tokens > limits.image_tokens_cap:
        raise RequestError(f"an image budget of {tokens} tokens ({max_pixels} pixels) is over this server's cap "
                           f"of {limits.image_tokens_cap} tokens", "max_pixels")
    settings = video_settings(request, limits) if request.video else limits.video
    messages, units, layouts, n_images = [], [], [], 0
    for i, message in enumerate(request.messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind not in ("image", "video"):
                    parts.append(part)
                    continue
                try:
                    if kind == "image":
                        pictures = pictures_of(part, max_pixels, limits.max_images - n_images)
                        n_images += len(pictures)
                        if n_images > limits.max_images:
                            raise RequestError(f"too many images: at most {limits.max_images} per request (a PDF's "
                                               "pages count as images)", "messages")
                        units.extend(preprocess(p, image_cfg, max_pixels=max_pixels) for p in pictures)
                        parts.extend({"type": kind} for _ in pictures)
                        deadline.check("decoding the image")
                        continue
                    if len(layouts) >= limits.max_videos:
                        raise RequestError(f"too many videos: at most {limits.max_videos} per request", "messages")
                    clip = (clips or ClipCache(0)).load(part["video"], image_cfg, settings, limits.max_video_seconds,
                                                        deadline, request.cache_salt)
                    units.extend(clip.pairs)
                    layouts.append(clip.layout())
                    deadline.check("decoding the video")
                except ImageError as exc:  # named by its place, as a client wrote it
                    code = "invalid_video" if isinstance(exc, VideoError) else "invalid_image"
                    raise RequestError(str(exc), f"messages[{i}].content[{j}]", code) from exc
                except DeadlineExceeded as exc:
                    raise RequestError(str(exc), f"messages[{i}].content[{j}]", "timeout") from None
                parts.append({"type": kind})
            content = parts
        messages.append({**message, "content": content})
    return messages, units, layouts


# The template variables qvl sets itself, which a request cannot replace.
_OWN_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                     "eos_token", "unk_token", "pad_token"})
MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(kwargs, param: str = "chat_template_kwargs") -> None:
    """Chat template variables from a request (vLLM's `chat_template_kwargs`): an object of at
    most MAX_TEMPLATE_KWARGS names, each a JSON scalar (string, number, boolean, null) and none
    a variable qvl sets itself. RequestError naming `param` (or the entry) otherwise."""
    if not isinstance(kwargs, dict):
        raise RequestError(f"{param} must be an object of template variables", param)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"{param} has {len(kwargs)} entries; at most {MAX_TEMPLATE_KWARGS} are accepted", param)
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise RequestError(f"{param}: {name!r} is not a template variable name", param)
        if name in _OWN_TEMPLATE_VARIABLES:
            raise RequestError(f"{param}: '{name}' is set by the server and cannot be given", f"{param}.{name}")
        if value is not None and type(value) not in (str, int, float, bool):
            raise RequestError(f"{param}: '{name}' must be a string, number, boolean or null, not "
                               f"{type(value).__name__}", f"{param}.{name}")


def parse_request(request: Request, tokenizer: Tokenizer, template: str, image_cfg: ImageProcessorConfig,
                  limits: Limits, clips: ClipCache | None = None, deadline: Deadline | None = None) -> ParsedRequest:
    """Decode images and videos (through `clips`), render and tokenize the conversation,
    check the context budget. Raises RequestError for anything unusable (an image or video
    that cannot be decoded names its part; so does one that takes past `deadline`), and
    `deadline`'s Cancelled once it is cancelled. A prompt whose text alone is over the
    context is refused before it is tokenized."""
    if not request.messages:
        raise RequestError("messages must not be empty", "messages")
    outside = [i for i, _ in request.sampling.logit_bias if not 0 <= i < tokenizer.vocab_size]
    if outside:
        raise RequestError(f"logit_bias names token {outside[0]}, outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                           "logit_bias")
    room = limits.max_context - request.sampling.max_new_tokens  # tokens the prompt may have
    if room < 1:
        raise RequestError(f"max_tokens asks for up to {request.sampling.max_new_tokens} tokens, but the context "
                           f"holds {limits.max_context} with the prompt; lower max_tokens", "messages",
                           "context_length_exceeded")
    check_template_kwargs(request.template_kwargs)
    deadline = deadline or Deadline()
    messages, images, layouts = _decode_media(request, image_cfg, limits, clips, deadline)
    try:
        tokens = tokenize_chat(tokenizer, template, messages, [im.num_tokens for im in images if not im.video],
                               tools=request.tools, video_layouts=layouts, max_tokens=room,
                               template_kwargs=request.template_kwargs)
    except PromptTooLong as exc:
        field = longest_text(messages, request.tools)
        raise RequestError(f"{exc}; the context of {limits.max_context} tokens leaves {room:,} for the "
                           f"prompt beside max_tokens {request.sampling.max_new_tokens}: shorten {field}", field,
                           "context_length_exceeded") from None
    try:
        deadline.check("tokenizing the prompt")
    except DeadlineExceeded as exc:
        raise RequestError(str(exc), "messages", "timeout") from None
    ids = torch.tensor(tokens.ids, dtype=torch.long)
    wanted = len(ids) + request.sampling.max_new_tokens
    if wanted > limits.max_context:
        raise RequestError(
            f"the prompt has {len(ids)} tokens and asks for up to {request.sampling.max_new_tokens} more, "
            f"but the context holds {limits.max_context}; shorten the conversation, lower max_tokens or the "
            f"image budget", "messages", "context_length_exceeded")
    return ParsedRequest(ids, images, request.sampling, reasoning=opens_reasoning(tokens.ids, tokenizer),
                         cache_salt=request.cache_salt)


def longest_text(messages: list[dict], tools: list[dict] | None) -> str:
    """The field holding the most text: "messages[i]" or "tools"."""
    fields = {f"messages[{i}]": message for i, message in enumerate(messages)} | {"tools": tools}
    return max(fields, key=lambda name: _characters(fields[name]))


def _characters(value) -> int:
    """Characters of the strings in `value`, through dicts and lists."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(_characters, value.values()))
    if isinstance(value, (list, tuple)):
        return sum(map(_characters, value))
    return 0


def opens_reasoning(ids: list[int], tokenizer: Tokenizer) -> bool:
    """Whether the generation prompt (after the last `<|im_start|>`) opens `<think>` without
    closing it, as a Thinking checkpoint's template does."""
    turn, start, end = (tokenizer.find(t) for t in ("<|im_start|>", "<think>", "</think>"))
    if None in (turn, start, end):  # a tokenizer without them: no reasoning to split
        return False
    last = len(ids) - 1 - ids[::-1].index(turn) if turn in ids else 0
    tail = ids[last:]
    return start in tail and end not in tail[len(tail) - 1 - tail[::-1].index(start):]
