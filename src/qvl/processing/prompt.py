"""Conversations -> prompt token ids, through the checkpoint's own Jinja chat template.

Rendering follows `transformers.utils.chat_template_utils` (the sandboxed environment,
its filters and globals, the message normalisation), so the ids are the ones
`apply_chat_template` + `Qwen3VLProcessor` would produce.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
import unicodedata
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qvl.processing.tokenizer import Tokenizer
from qvl.processing.video import timestamp_text

IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"

# Names a message's reasoning may be passed under; templates read "reasoning_content".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def load_chat_template(model_dir: str | Path) -> str:
    """The checkpoint's own template: chat_template.jinja, chat_template.json, tokenizer_config.json."""
    model_dir = Path(model_dir)
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        template = _pick_template(json.loads(path.read_text(encoding="utf-8")).get("chat_template"), path)
        if template is not None:
            return template
    raise ValueError(
        f"no chat template in {model_dir}: expected chat_template.jinja, chat_template.json "
        "or a 'chat_template' entry in tokenizer_config.json"
    )


def _pick_template(value: Any, path: Path) -> str | None:
    # A template is a string, or a list of {"name": ..., "template": ...} of which we take "default".
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{path}: chat_template lists {sorted(map(str, named))} but no 'default' template")
    raise ValueError(f"{path}: chat_template must be a string or a list of named templates")


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


class _GenerationExtension(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks it)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    # `dict(...)` in templates, without exposing the dict type itself.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # A namespace that refuses underscore-prefixed attributes.
    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike jinja's own filter: no HTML escaping, and the json.dumps options are exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationExtension, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Rebuild `value` from JSON types; anything else (images, arrays) becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: list[dict]) -> list[dict]:
    # As apply_chat_template: plain data, None-valued keys dropped, reasoning aliased.
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
    """Render `messages` with `template` exactly as transformers' apply_chat_template does.

    `extra` becomes template variables (tools, documents, enable_thinking, eos_token, ...).
    """
    variables = {"tools": None, "documents": None, **_plain(extra)}
    return _compile(template).render(
        messages=_normalize_messages(messages), add_generation_prompt=add_generation_prompt, **variables
    )


# ---------------------------------------------------------------------------------------
# Tokenizing
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PromptTokens:
    ids: list[int]  # each image's pad token expanded to its token count, each video's to its frame pairs
    image_token_counts: tuple[int, ...]


# A video's layout: (seconds, tokens) of each frame pair, in order.
VideoLayout = list[tuple[float, int]]


class PromptTooLong(ValueError):
    """The rendered prompt cannot fit in the tokens allowed, whatever its text encodes to."""

    def __init__(self, chars: int, least: int, longest: int):
        super().__init__(f"the prompt has {chars:,} characters of text: at least {least:,} tokens, as a token holds "
                         f"at most {longest} characters")
        self.chars, self.least = chars, least


def count_image_parts(messages: list[dict]) -> int:
    """Image parts in the messages, recognised as the Qwen templates recognise them."""
    return sum(1 for part in _parts(messages) if _is_image_part(part))


def count_video_parts(messages: list[dict]) -> int:
    """Video parts in the messages, recognised as the Qwen templates recognise them."""
    return sum(1 for part in _parts(messages) if not _is_image_part(part) and _is_video_part(part))


def _parts(messages: list[dict]):
    for message in messages:
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            yield from (part for part in content if isinstance(part, Mapping))


def _is_image_part(part: Mapping) -> bool:
    return part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part


def _is_video_part(part: Mapping) -> bool:
    return part.get("type") == "video" or "video" in part


def tokenize_chat(
    tokenizer: Tokenizer,
    template: str,
    messages: list[dict],
    image_token_counts: list[int],
    *,
    image_pad_token: str = IMAGE_PAD_TOKEN,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    video_layouts: list[VideoLayout] = (),
    max_tokens: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> PromptTokens:
    """Render, encode, and expand the k-th image pad token to `image_token_counts[k]` copies
    and the k-th video pad token to `<t seconds><|vision_start|>` + pads + `<|vision_end|>`
    per frame pair of `video_layouts[k]`. A rendered prompt whose characters alone make more
    than `max_tokens` tokens is refused (PromptTooLong) before anything is encoded.
    `template_kwargs` are further template variables (`enable_thinking`, ...); their strings
    are text, as the messages' are.

    Same ids as transformers' Qwen3VLProcessor, which expands the pad tokens in the text
    before encoding: the pad is an added token, so expanding ids after encoding is equal.
    Only the template makes special tokens: one written in the messages is encoded as text.
    """
    counts = tuple(int(c) for c in image_token_counts)
    n_parts = count_image_parts(messages)
    if n_parts != len(counts):
        raise ValueError(f"the messages hold {n_parts} image(s) but {len(counts)} image token count(s) were given")
    if any(c < 0 for c in counts):
        raise ValueError(f"image token counts must be non-negative, got {list(counts)}")
    if (n_videos := count_video_parts(messages)) != len(video_layouts):
        raise ValueError(f"the messages hold {n_videos} video(s) but {len(video_layouts)} video layout(s) were given")
    guard = _MessageText(tokenizer.special_added_tokens)
    text = render_chat(
        template, guard.protect(messages), add_generation_prompt=add_generation_prompt,
        tools=guard.protect(tools) if tools else None,
        **guard.protect(dict(template_kwargs or {})), **tokenizer.special_tokens_map,
    )
    pad_id = tokenizer.token_id(image_pad_token)
    video_id = tokenizer.token_id(VIDEO_PAD_TOKEN) if video_layouts else None
    pieces = guard.split(text)
    if max_tokens is not None:
        longest = tokenizer.longest_token
        chars = [len(unicodedata.normalize("NFC", p)) for p in pieces if isinstance(p, str)]  # as encoded
        least = len(pieces) - len(chars) + sum((n + longest - 1) // longest for n in chars)  # a char is >= 1 byte
        if least > max_tokens:
            raise PromptTooLong(sum(chars), least, longest)
    ids: list[int] = []
    for piece in pieces:
        ids += [piece] if isinstance(piece, int) else tokenizer.encode(piece, special_tokens=False)
    for token, name, wanted, what in ((pad_id, image_pad_token, len(counts), "image token count(s)"),
                                      (video_id, VIDEO_PAD_TOKEN, len(video_layouts), "video layout(s)")):
        if token is not None and (n_pads := ids.count(token)) != wanted:
            raise ValueError(f"the rendered prompt holds {n_pads} {name} token(s) but {wanted} "
                             f"{what} were given (does the text itself contain the pad token?)")
    images, videos = iter(counts), iter(video_layouts)
    expanded: list[int] = []
    for token in ids:
        if token == pad_id:
            expanded.extend([pad_id] * next(images))
        elif token == video_id:
            expanded.extend(video_tokens(tokenizer, next(videos), video_id))
        else:
            expanded.append(token)
    return PromptTokens(ids=expanded, image_token_counts=counts)


def video_tokens(tokenizer: Tokenizer, layout: VideoLayout, video_id: int) -> list[int]:
    """The ids that replace one video's pad: `<t seconds>` (the pair's time as text), then
    `<|vision_start|>`, the pair's pads and `<|vision_end|>`, for each frame pair."""
    start, end = tokenizer.token_id("<|vision_start|>"), tokenizer.token_id("<|vision_end|>")
    out: list[int] = []
    for seconds, n in layout:
        out += tokenizer.encode(timestamp_text(seconds), special_tokens=False)
        out += [start] + [video_id] * n + [end]
    return out


class _MessageText:
    """Keeps the text of the messages from producing special tokens.

    Before rendering, every special token written in a message string or dict key (and a
    string's start or end that could join the template's text or the next part into one) is
    swapped for a placeholder of private-use characters with a per-call nonce. In the rendered
    prompt, the special tokens left are the template's own; the text between them gets its
    placeholders back and is encoded with special tokens off. The tokenizer splits at added tokens before
    anything else, so encoding the pieces one by one gives the ids of the whole string, and
    prompts without such text keep transformers' ids exactly.
    """

    def __init__(self, specials: dict[str, int]):
        self.specials = specials
        self.nonce = secrets.token_hex(8)
        self.literals: list[str] = []
        longest_first = sorted(specials, key=len, reverse=True)  # leftmost-longest, as the tokenizer matches
        self.pattern = re.compile("|".join(map(re.escape, longest_first))) if specials else None
        self.placeholder = re.compile(f"\ue000{self.nonce}(\\d+)\ue001")
        # the proper prefixes and suffixes of the special tokens: a string may end with the one or
        # begin with the other (see _protect_text)
        self.starts = {t[:n] for t in specials for n in range(1, len(t))}
        self.ends = {t[-n:] for t in specials for n in range(1, len(t))}
        self.edge = max(map(len, specials), default=1) - 1

    def _hide(self, literal: str) -> str:
        self.literals.append(literal)
        return f"\ue000{self.nonce}{len(self.literals) - 1}\ue001"

    def _protect_text(self, text: str) -> str:
        if self.pattern is None:
            return text
        text = self.pattern.sub(lambda m: self._hide(m.group()), text)
        # A string may end with the start of a special token and the next piece of the
        # prompt finish it (or begin with the end of one): hide those edges too.
        edge = min(self.edge, len(text))
        head = max((n for n in range(1, edge + 1) if text[:n] in self.ends), default=0)
        tail = max((n for n in range(1, edge + 1) if text[-n:] in self.starts), default=0)
        if head + tail > len(text):
            return self._hide(text)
        end = len(text) - tail
        return (self._hide(text[:head]) if head else "") + text[head:end] + (self._hide(text[end:]) if tail else "")

    def protect(self, value: Any) -> Any:
        """`value` with every string in it protected, dict keys included (templates write
        tool schemas and call arguments with `tojson`, keys and all); non-strings left alone."""
        if isinstance(value, str):
            return self._protect_text(value)
        if isinstance(value, Mapping):
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.protect(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.protect(v) for v in value)
        return value

    def split(self, text: str) -> list[str | int]:
        """The rendered prompt as the template's special tokens (ids) and the text between
        them, each message's literals put back (to be encoded as text)."""
        pieces: list[str | int] = []
        start = 0
        for match in self.pattern.finditer(text) if self.pattern else ():
            pieces += [self._restore(text[start:match.start()]), self.specials[match.group()]]
            start = match.end()
        return [p for p in pieces + [self._restore(text[start:])] if p != ""]

    def _restore(self, text: str) -> str:
        return self.placeholder.sub(lambda m: self.literals[int(m.group(1))], text)
