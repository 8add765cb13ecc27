"""Embeddings and relevance scores on the engine: each input a request that ends after its
prefill (the scheduler's last_hidden requests: images through the vision cache, prompts in
slices, shared prefixes from the prefix cache), answered with its last token's final-normed
hidden state; then the reference's head on it (normalised vector, or sigmoid of the yes-no
logit difference)."""

from __future__ import annotations

import torch

from qvl.deadline import Deadline
from qvl.requests import ParsedRequest, Request, RequestError
from qvl.retrieval.prompts import embedding_messages, rerank_messages
from qvl.retrieval.task import EMBED, RERANK
from qvl.sampling import SamplingParams
from qvl.stream import Done

PREFILL_ONLY = SamplingParams(max_new_tokens=1)  # nothing is decoded; the context check counts one token
REFERENCE_VIDEO = {"fps": 1.0, "max_frames": 64}  # the reference samples clips at 1 fps, 64 frames at most


def parse_embedding(engine, parts: list[dict], instruction: str | None = None, deadline: Deadline | None = None,
                    salt: str = "") -> ParsedRequest:
    """One input of an embedding model, checked and tokenized (RequestError when unusable)."""
    request = Request(embedding_messages(parts, instruction), PREFILL_ONLY, video=REFERENCE_VIDEO, cache_salt=salt)
    return engine.parse(request, deadline, EMBED)


def parse_pair(engine, query: list[dict], document: list[dict], instruction: str | None = None,
               deadline: Deadline | None = None, salt: str = "") -> ParsedRequest:
    """One (query, document) pair of a reranker, checked and tokenized."""
    request = Request(rerank_messages(query, document, instruction), PREFILL_ONLY, video=REFERENCE_VIDEO,
                      cache_salt=salt)
    return engine.parse(request, deadline, RERANK)


def check_dimensions(dimensions: int | None, width: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= width:
        raise RequestError(f"dimensions must be between 1 and the model's {width}, got {dimensions}", "dimensions")


def embedding(hidden: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
    """hidden [D] -> its first `dimensions` entries (Matryoshka), L2-normalised [d] float32."""
    head = hidden.float()[:dimensions]
    return head / head.norm().clamp_min(1e-12)


@torch.inference_mode()
def score_vector(engine) -> torch.Tensor:
    """lm_head's row of "yes" minus its row of "no" [D] float32: the reranker's one-logit head."""
    ids = torch.tensor([engine.tokenizer.token_id("yes"), engine.tokenizer.token_id("no")])
    head = engine.model.lm_head
    rows = head.dequantized(ids) if hasattr(head, "dequantized") else head.weight[ids]
    rows = rows.float()
    return rows[0] - rows[1]


def relevance(hidden: torch.Tensor, vector: torch.Tensor) -> float:
    """sigmoid(hidden . (w_yes - w_no)): the probability of "yes" against "no"."""
    return torch.sigmoid(hidden.float() @ vector).item()


def answered(results: list) -> list[Done]:
    """Engine.generate_batch's results, the first failure raised."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def embed(engine, inputs: list[list[dict]], instruction: str | None = None,
          dimensions: int | None = None) -> tuple[torch.Tensor, int]:
    """Embeddings of several inputs together [N, d] and the prompt tokens they took."""
    check_dimensions(dimensions, engine.cfg.text.hidden_size)
    dones = answered(engine.generate_batch([parse_embedding(engine, parts, instruction) for parts in inputs]))
    return torch.stack([embedding(d.hidden, dimensions) for d in dones]), sum(d.usage.prompt_tokens for d in dones)


def rerank(engine, query: list[dict], documents: list[list[dict]],
           instruction: str | None = None) -> tuple[list[float], int]:
    """The relevance of each document to the query, in their order, and the prompt tokens taken."""
    pairs = [parse_pair(engine, query, doc, instruction) for doc in documents]
    dones, vector = answered(engine.generate_batch(pairs)), score_vector(engine)
    return [relevance(d.hidden, vector) for d in dones], sum(d.usage.prompt_tokens for d in dones)
