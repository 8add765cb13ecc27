"""Chat requests: what a front door hands the engine, and its checked, tokenized form."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qvl.processing.image import (
    ImageError,
    ImageProcessorConfig,
    ProcessedImage,
    load_image,
    max_pixels_for_tokens,
    preprocess,
)
from qvl.processing.prompt import tokenize_chat
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
    "image": path | bytes | PIL.Image}]}] (assistant messages may carry "tool_calls", and
    "tool" messages answer them, as the chat template renders them); max_image_tokens
    overrides the engine budget; tools (OpenAI function tools) go into the prompt."""

    messages: list[dict]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_image_tokens: int | None = None
    tools: list[dict] | None = None


@dataclass
class ParsedRequest:
    """A request checked and tokenized; images decoded and preprocessed, not yet encoded."""

    ids: torch.Tensor  # [T] long, image placeholders expanded
    images: list[ProcessedImage]
    sampling: SamplingParams
    answer_checked: bool = False  # the answer cache was already asked (and missed)
    reasoning: bool = False  # the prompt opened `<think>`: the answer starts with reasoning

    @property
    def image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)

    @property
    def image_hashes(self) -> list[str]:
        return [im.content_hash for im in self.images]


@dataclass(frozen=True)
class Limits:
    max_image_tokens: int  # default budget per image
    image_tokens_cap: int  # the most a request may ask for
    max_images: int
    max_context: int


def _decode_images(request: Request, image_cfg: ImageProcessorConfig, limits: Limits):
    """Template-ready messages (image parts reduced to {"type": "image"}) and the images."""
    tokens = request.max_image_tokens or limits.max_image_tokens
    if tokens < 1:
        raise RequestError("max_image_tokens must be >= 1", "max_image_tokens")
    max_pixels = max_pixels_for_tokens(tokens, image_cfg)
    if tokens > limits.image_tokens_cap:
        raise RequestError(f"an image budget of {tokens} tokens ({max_pixels} pixels) is over this server's cap "
                           f"of {limits.image_tokens_cap} tokens", "max_pixels")
    messages, images = [], []
    for i, message in enumerate(request.messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "image":
                    parts.append(part)
                    continue
                if len(images) >= limits.max_images:
                    raise RequestError(f"too many images: at most {limits.max_images} per request", "messages")
                try:
                    images.append(preprocess(load_image(part["image"]), image_cfg, max_pixels=max_pixels))
                except ImageError as exc:  # named by its place, as a client wrote it
                    raise RequestError(str(exc), f"messages[{i}].content[{j}]", "invalid_image") from exc
                parts.append({"type": "image"})
            content = parts
        messages.append({**message, "content": content})
    return messages, images


def parse_request(request: Request, tokenizer: Tokenizer, template: str, image_cfg: ImageProcessorConfig,
                  limits: Limits) -> ParsedRequest:
    """Decode images, render and tokenize the conversation, check the context budget.
    Raises RequestError for anything unusable (an image that cannot be decoded names its part)."""
    if not request.messages:
        raise RequestError("messages must not be empty", "messages")
    outside = [i for i, _ in request.sampling.logit_bias if not 0 <= i < tokenizer.vocab_size]
    if outside:
        raise RequestError(f"logit_bias names token {outside[0]}, outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                           "logit_bias")
    messages, images = _decode_images(request, image_cfg, limits)
    tokens = tokenize_chat(tokenizer, template, messages, [im.num_tokens for im in images], tools=request.tools)
    ids = torch.tensor(tokens.ids, dtype=torch.long)
    wanted = len(ids) + request.sampling.max_new_tokens
    if wanted > limits.max_context:
        raise RequestError(
            f"the prompt has {len(ids)} tokens and asks for up to {request.sampling.max_new_tokens} more, "
            f"but the context holds {limits.max_context}; shorten the conversation, lower max_tokens or the "
            f"image budget", "messages", "context_length_exceeded")
    return ParsedRequest(ids, images, request.sampling, reasoning=opens_reasoning(tokens.ids, tokenizer))


def opens_reasoning(ids: list[int], tokenizer: Tokenizer) -> bool:
    """Whether the generation prompt (after the last `<|im_start|>`) opens `<think>` without
    closing it, as a Thinking checkpoint's template does."""
    turn, start, end = (tokenizer.find(t) for t in ("<|im_start|>", "<think>", "</think>"))
    if None in (turn, start, end):  # a tokenizer without them: no reasoning to split
        return False
    last = len(ids) - 1 - ids[::-1].index(turn) if turn in ids else 0
    tail = ids[last:]
    return start in tail and end not in tail[len(tail) - 1 - tail[::-1].index(start):]
