"""The conversations Qwen3-VL-Embedding and Qwen3-VL-Reranker were trained on, as the official
implementation builds them (QwenLM/Qwen3-VL-Embedding: src/models/qwen3_vl_embedding.py and
qwen3_vl_reranker.py). An input is a list of content parts ({"type": "text", "text"},
{"type": "image", "image"}, {"type": "video", "video"}); its videos come first, then its
images, then its texts, whatever order they were given in, as the reference lays them out."""

from __future__ import annotations

import unicodedata

from qvl.requests import RequestError

EMBED_INSTRUCTION = "Represent the user's input."
RERANK_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
EMPTY_INPUT = "NULL"  # what the reference embeds for an input without any part
PART_ORDER = {"video": 0, "image": 1, "text": 2}


def as_parts(value, param: str) -> list[dict]:
    """An input as content parts: a string is one text part; a list must hold parts of the
    three kinds. RequestError naming `param` (or the part) otherwise."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise RequestError("an input is a string or a list of content parts", param)
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_ORDER:
            raise RequestError(f"a content part has a type, one of {', '.join(PART_ORDER)}", f"{param}[{i}]")
        content = part.get(kind)
        if content is None or (kind == "text" and not isinstance(content, str)):
            raise RequestError(f"a part of type '{kind}' needs a '{kind}' field", f"{param}[{i}]")
    return value


def laid_out(parts: list[dict]) -> list[dict]:
    """Videos, then images, then texts (each kind in its given order); "NULL" for no part."""
    if not parts:
        return [{"type": "text", "text": EMPTY_INPUT}]
    return sorted(parts, key=lambda part: PART_ORDER[part["type"]])


def embedding_instruction(instruction: str | None) -> str:
    """The instruction stripped, with a period when it ends without punctuation; the default
    for none (or an empty one)."""
    instruction = (instruction or "").strip()
    if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
        instruction += "."
    return instruction or EMBED_INSTRUCTION


def embedding_messages(parts: list[dict], instruction: str | None = None) -> list[dict]:
    """System: the instruction; user: the input's parts."""
    return [{"role": "system", "content": [{"type": "text", "text": embedding_instruction(instruction)}]},
            {"role": "user", "content": laid_out(parts)}]


def rerank_messages(query: list[dict], document: list[dict], instruction: str | None = None) -> list[dict]:
    """System: the judging rule; user: "<Instruct>: ...", "<Query>:" and the query's parts,
    "\\n<Document>:" and the document's parts (the instruction as given: no period added)."""
    content = [{"type": "text", "text": f"<Instruct>: {instruction or RERANK_INSTRUCTION}"},
               {"type": "text", "text": "<Query>:"}, *laid_out(query),
               {"type": "text", "text": "\n<Document>:"}, *laid_out(document)]
    return [{"role": "system", "content": [{"type": "text", "text": RERANK_SYSTEM}]},
            {"role": "user", "content": content}]
