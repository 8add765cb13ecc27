"""Sampling parameters and pure sampler functions over logits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qvl.grammar import Constraint


MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (dividing by ~0 overflows)
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (negative: mod 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks force exactly max_new_tokens
    min_tokens: int = 0  # EOS is not sampled before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's logit_bias
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k best alternatives
    n: int = 1  # answers to the same prompt, forked after one prefill; sampled ones use `generator(index)`
    constraint: Constraint | None = None  # what the answer must match (a JSON schema, regex, grammar)
    reasoning_budget: int | None = None  # a Thinking model's reasoning tokens before `</think>` is forced

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"top_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (0.01 <= self.repetition_penalty <= 100, "repetition_penalty must be in [0.01, 100]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.n >= 1, "n must be >= 1"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, f"seed must be in [{SEED_MIN}, {SEED_MAX}]"),
            (self.reasoning_budget is None or self.reasoning_budget >= 0, "reasoning_budget must be >= 0"),
            (self.constraint is None or not self.ignore_eos, "ignore_eos cannot be combined with a grammar: "
             "the grammar decides where the answer ends"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def deterministic(self) -> bool:
        """Same inputs give the same output (greedy, or sampled with a fixed seed)."""
        return self.greedy or self.seed is not None

    def generator(self, index: int) -> torch.Generator | None:
        """The random numbers of answer `index` of n: seeded (seed + index) mod 2**64 (a seed
        near the top of the range wraps to 0, 1, ... rather than overflowing); None unseeded."""
        if self.seed is None:
            return None
        return torch.Generator().manual_seed((self.seed + index) % 2**64)


def apply_penalties(
    logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """logits: [B, V] float32; seen: [B, V] bool (prompt + output tokens);
    counts: [B, V] output-token counts. Repetition penalty as transformers applies it
    (divide positive logits, multiply negative ones); presence and frequency penalties
    as OpenAI defines them (over the output)."""
    if params.repetition_penalty != 1.0:
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    return logits


NUCLEUS_START = 256  # top_p without top_k: candidates first tried (grown 8x until they hold top_p)


def candidates(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens one row may sample: logits [V] (temperature applied) -> (their logits,
    their ids), most likely first when a filter applies (the whole row, in id order, when
    none does). Filters as transformers and vLLM apply them: min_p (probability at least
    min_p times the top one's), then top_k, then top_p (the smallest top slice of what is
    left holding top_p of its probability, the most likely token always kept: a top_p below
    float32's range keeps just it). Never sorts the vocabulary: top_k and top_p need only
    the top of it (a full sort of 151,936 logits takes ~30 ms)."""
    vocab = logits.shape[-1]
    if min_p > 0:
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
    if top_k and top_k < vocab:
        values, ids = torch.topk(logits, top_k)
        total = torch.logsumexp(values, -1)
    elif top_p < 1.0:
        total = torch.logsumexp(logits, -1)
        k = NUCLEUS_START
        while True:  # usually once: a nucleus rarely holds more than a few hundred tokens
            values, ids = torch.topk(logits, min(k, vocab))
            if k >= vocab or float((values - total).exp().sum()) >= top_p:
                break
            k *= 8
    else:
        finite = torch.isfinite(logits)
        if bool(finite.all()):
            return logits, torch.arange(vocab)
        ids = finite.nonzero().squeeze(-1)
        return logits[ids], ids
    finite = torch.isfinite(values)
    values, ids = values[finite], ids[finite]
    if top_p < 1.0:
        probs = (values - total).exp()
        keep = (probs.cumsum(-1) - probs) < top_p
        keep[0] = True
        values, ids = values[keep], ids[keep]
    return values, ids


def draw(values: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index into `values` (logits [N]) drawn with probability softmax(values), by inverting
    the cumulative distribution at one uniform number: each draw takes exactly one number
    from the generator, however many candidates there are, so a seeded row's later draws do
    not shift when a rounding moves the nucleus's edge by a token (and it is ~100x cheaper
    than torch.multinomial over a vocabulary)."""
    cdf = torch.softmax(values, -1).double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(values) - 1)


def sample(logits: torch.Tensor, params: SamplingParams,
           generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """logits: [B, V] float32 (penalties applied) -> token ids [B]. generators: one per row
    (seeded requests), so that a row draws the same numbers whatever else is in the batch."""
    if params.greedy:
        return logits.argmax(-1)
    out = []
    for row in range(logits.shape[0]):
        values, ids = candidates(logits[row] / params.temperature, params.top_k, params.top_p, params.min_p)
        out.append(int(ids[draw(values, None if generators is None else generators[row])]))
    return torch.tensor(out)


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [B, V] plus each row's logit_bias (ids outside the vocabulary are refused when
    the request is checked)."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor([i for i, _ in params.logit_bias])
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype)
    return logits.index_add(-1, ids, bias.expand(logits.shape[0], -1))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its k most likely tokens with theirs, from
    raw logits [V] (before temperature, penalties and filters: what the model said)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    best = torch.topk(logprobs, k) if k else None
    return float(logprobs[token]), [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
