"""What a checkpoint is for: generate (chat), embed (Qwen3-VL-Embedding) or rerank
(Qwen3-VL-Reranker). The three share config.json's architecture (Qwen3VLForConditionalGeneration);
an embedding or reranker folder says what it is in its sentence-transformers files, and a
download of one without them by its name."""

from __future__ import annotations

import json
from pathlib import Path

from qvl.requests import RequestError

GENERATE, EMBED, RERANK = "generate", "embed", "rerank"
# config_sentence_transformers.json's model_type -> task
SENTENCE_TRANSFORMERS_TYPES = {"SentenceTransformer": EMBED, "CrossEncoder": RERANK}
NAME_MARKS = {"qwen3-vl-embedding": EMBED, "qwen3-vl-reranker": RERANK}  # in a folder or hub id, any case


def model_task(path: Path, name: str | None = None) -> str:
    """The task of the checkpoint in `path` (opened as `name`: a hub id or folder): its
    config_sentence_transformers.json's model_type, else a name holding Qwen3-VL-Embedding or
    Qwen3-VL-Reranker (a hub download's cache folder keeps it), else generate."""
    marker = path / "config_sentence_transformers.json"
    if marker.is_file():
        kind = json.loads(marker.read_text(encoding="utf-8")).get("model_type", "SentenceTransformer")
        if kind not in SENTENCE_TRANSFORMERS_TYPES:
            raise ValueError(f"{marker}: model_type '{kind}' is not one qvl serves "
                             f"({', '.join(SENTENCE_TRANSFORMERS_TYPES)})")
        return SENTENCE_TRANSFORMERS_TYPES[kind]
    names = " ".join([str(path.resolve()), name or ""]).lower()
    return next((task for mark, task in NAME_MARKS.items() if mark in names), GENERATE)


DOORS = {GENERATE: "chat and completions (/v1/chat/completions, /v1/responses, /api/chat, /api/generate)",
         EMBED: "embeddings (POST /v1/embeddings, /api/embed; qvl embed)",
         RERANK: "reranking (POST /v1/rerank, /v1/score; qvl rerank)"}
KINDS = {GENERATE: "a chat model", EMBED: "an embedding model (Qwen3-VL-Embedding)",
         RERANK: "a reranker (Qwen3-VL-Reranker)"}
NEEDS = {GENERATE: "chat, serve a chat checkpoint (Qwen3-VL Instruct or Thinking)",
         EMBED: "embeddings, serve a Qwen3-VL-Embedding checkpoint",
         RERANK: "reranking, serve a Qwen3-VL-Reranker checkpoint"}


def wrong_task(model: str, task: str, wanted: str) -> RequestError:
    """The error for a request of another task than the model's: what the model is, what it
    answers, what the request would need (400, naming the field "model")."""
    return RequestError(f"the model {model} is {KINDS[task]}: it answers {DOORS[task]} only; for {NEEDS[wanted]}",
                        "model", "wrong_model_task")
