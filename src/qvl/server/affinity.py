"""Which replica should answer a request: a key naming the content whose cached work (vision
features, prefix keys/values) a replica may already hold. Pure functions of the route and
the body, no Ray, so the cluster's front and the tests share them.

The key is the first image (or video) the request carries, by its bytes or URL: a follow-up
question about a photo, in a new chat or the same one, goes where the photo's features are.
A request without one is keyed by its leading messages (the system prompt and the first user
turn): the next turn of a conversation repeats them, so it goes where its prefix is. A body
that is not JSON has no key (any replica answers it, with the same 400). Keys name their kind
("media:..." or "lead:..."): ray_router holds media keys harder.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

MEDIA_PARTS = ("image_url", "video_url", "input_image")  # OpenAI chat and Responses part types


def routing_key(path: str, body: bytes) -> str | None:
    """A short hex key for the body sent to `path`, or None when nothing in it is worth
    following (not JSON, no messages)."""
    if not body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    if path.startswith("/api/"):
        media, lead = ollama_content(request)
    elif path == "/v1/responses":
        media, lead = responses_content(request)
    else:
        media, lead = chat_content(request.get("messages"))
    if media is not None:
        return digest("media", media)
    return digest("lead", lead) if lead else None


def digest(kind: str, content: Any) -> str:
    """'<kind>:<hex>': the router holds media keys harder than conversation keys."""
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, ensure_ascii=False)
    return f"{kind}:" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def media_source(part: Any) -> str | None:
    """The URL / data URI of an image or video part, in either API's shape."""
    if not isinstance(part, dict) or part.get("type") not in MEDIA_PARTS:
        return None
    value = part.get(part["type"]) if part["type"] != "input_image" else part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


def chat_content(messages: Any) -> tuple[str | None, list]:
    """(first media source, the messages up to and including the first user message)."""
    if not isinstance(messages, list):
        return None, []
    lead: list = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            source = media_source(part)
            if source is not None:
                return source, []
        if not lead or lead[-1].get("role") != "user":
            lead.append({"role": message.get("role"), "content": content})
    return None, lead


def responses_content(request: dict) -> tuple[str | None, list]:
    items = request.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    media, lead = chat_content(items if isinstance(items, list) else [])
    instructions = request.get("instructions")
    return media, ([{"role": "system", "content": instructions}] if instructions else []) + lead


def ollama_content(request: dict) -> tuple[str | None, list]:
    """/api/chat carries messages with an `images` list (base64); /api/generate a prompt,
    a system text and `images`."""
    messages = request.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if (image := first_image(message)) is not None:
                return image, []
        return chat_content(messages)
    if (image := first_image(request)) is not None:
        return image, []
    prompt = request.get("prompt")
    return None, [{"system": request.get("system")}, {"prompt": prompt}] if prompt else []


def first_image(holder: Any) -> str | None:
    """The first base64 image of an Ollama message or request (its `images` list)."""
    images = holder.get("images") if isinstance(holder, dict) else None
    return images[0] if isinstance(images, list) and images and isinstance(images[0], str) else None
