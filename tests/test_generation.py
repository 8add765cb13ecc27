"""Sampling functions, stop handling and the event stream."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qvl.engine import Request
from qvl.sampling import SamplingParams, apply_penalties, candidates, sample
from qvl.stream import Done, StopStrings, TextStream, Timings, Usage


@given(st.integers(0, 50), st.floats(0.05, 0.999) | st.just(1.0), st.sampled_from([0.0, 0.01, 0.2]), st.integers(0, 2**31 - 1),
       st.sampled_from([64, 3000]))
@settings(max_examples=80, deadline=None)
def test_filters_keep_the_minimal_top_slice(k, p, min_p, seed, vocab):
    """min_p, then top_k, then top_p over what is left (the reference: a full sort), with a
    vocabulary larger than the first nucleus guess too."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    values, ids = candidates(logits, k, p, min_p)
    order = logits.argsort(descending=True)
    survivors = logits[order] >= logits.max() + (torch.log(torch.tensor(min_p)) if min_p else -float("inf"))
    ranked = order[survivors][: k or None]
    probs = logits[ranked].softmax(-1)
    before = probs.cumsum(-1) - probs  # the probability ranked above each token
    # the nucleus: tokens with less than p above them; one whose sum is within float32 rounding
    # of p may fall on either side (the kernel sums in another order)
    least, most = (max(1, int((before < p + d).sum())) if p < 1 else len(ranked) for d in (-1e-5, 1e-5))
    n = len(ids)
    assert least <= n <= most, (least, n, most)
    assert sorted(ids.tolist()) == sorted(ranked[:n].tolist()) and torch.equal(values, logits[ids])


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[3, 7, 7, 50, 99]])
    seen = torch.zeros(1, 100, dtype=torch.bool)
    seen[0, ids[0]] = True
    params = SamplingParams(repetition_penalty=1.3)
    ours = apply_penalties(logits, seen, torch.zeros(1, 100), params)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, 5)
    counts = torch.tensor([[0.0, 1, 3, 0, 0]])
    out = apply_penalties(logits, counts > 0, counts, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0]]


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7)
    a = sample(logits, params, [torch.Generator().manual_seed(7) for _ in range(3)])
    b = sample(logits, params, [torch.Generator().manual_seed(7) for _ in range(3)])
    assert torch.equal(a, b)
    assert torch.equal(sample(logits, SamplingParams(), None), logits.argmax(-1))


def test_each_seeded_row_samples_as_if_it_were_alone():
    """A seeded request's tokens do not depend on the other rows of its batch."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.5, seed=11)
    together = sample(logits, params, [torch.Generator().manual_seed(11) for _ in range(3)])
    for r in range(3):
        alone = sample(logits[r : r + 1], params, [torch.Generator().manual_seed(11)])
        assert together[r] == alone[0]


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("max_new_tokens", 0),
                                         ("presence_penalty", 3), ("repetition_penalty", 0)])
def test_sampling_params_reject_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(("STOP",))
    assert s.push("abc S") == ("abc ", False)  # only "S" could still become "STOP"
    assert s.push("TO") == ("", False)
    assert s.push("Px") == ("", True)
    s = StopStrings(("##", "xyz"))
    assert s.push("a#") == ("a", False)
    assert s.push("b") == ("#b", False)
    assert s.push("xy") == ("", False)
    assert s.flush() == "xy"


def run_stream(tokenizer, ids, stops=(), eos=(151645,)):
    """Push ids into a TextStream as the scheduler does: until it finishes, then close it."""
    text, deltas = TextStream(tokenizer, stops, eos, Usage(), Timings(), 0.0), []
    for token in ids:
        deltas.append(text.push(token))
        if text.finished:
            break
    tail, done = text.close()
    return [d for d in [*deltas, tail] if d is not None], done


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=80, deadline=None)
def test_stream_deltas_concatenate_to_the_text(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, special_tokens=False)  # "<|im_end|>" in the text is text, not EOS
    deltas, done = run_stream(tiny_tokenizer, ids)
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert "".join(d.text for d in deltas) == done.text == tiny_tokenizer.decode(ids)
    full = tiny_tokenizer.decode(ids)
    if "\ufffd" not in full:
        assert all("\ufffd" not in d.text for d in deltas)


def test_stream_multibyte_characters_split_across_tokens(tiny_tokenizer):
    text = "OCR: 𝄞 🤖 龘 你好"
    ids = tiny_tokenizer.encode(text)
    assert len(ids) > len(text.split()) + 4  # some characters really are split into byte tokens
    deltas, done = run_stream(tiny_tokenizer, ids + [151645])
    assert done.text == text and done.finish_reason == "stop"
    assert all("\ufffd" not in d.text for d in deltas)


def test_stream_stop_string_truncates_and_finishes(tiny_tokenizer):
    ids = tiny_tokenizer.encode("line one\nEND of it\nmore")
    deltas, done = run_stream(tiny_tokenizer, ids, stops=("END",))
    assert done.text == "line one\n" and done.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == done.text


def test_engine_stream_reports_usage_and_timings(tiny_engine):
    from PIL import Image

    image = Image.new("RGB", (100, 70), (200, 10, 10))
    request = Request([{"role": "user", "content": [{"type": "image", "image": image},
                                                    {"type": "text", "text": "What colour?"}]}],
                      SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    events = list(tiny_engine.stream(request))
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert done.usage.completion_tokens == 6 == len(done.token_ids)
    # 100x70 is below the 65,536-pixel minimum: upscaled to 320x224, 10x7 tokens
    assert done.usage.image_tokens == 70
    assert done.usage.prompt_tokens > done.usage.image_tokens
    t = done.timings
    assert t.vision_ms > 0 and t.ttft_ms >= t.vision_ms and t.decode_ms_per_token > 0


def test_default_max_new_tokens_is_generous(tiny_engine):
    assert tiny_engine.sampling_defaults().max_new_tokens >= 1024


@pytest.fixture(scope="module")
def uncached_engine(tiny_checkpoint):
    """The default path without the answer cache, so that a repeated request is computed again."""
    from qvl.engine import Engine, EngineOptions

    return Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, answer_cache_entries=0))


def test_batched_decoding_matches_one_at_a_time(uncached_engine):
    """Rows of different prompt lengths decoded together give the same greedy text."""
    from PIL import Image

    tiny_engine = uncached_engine
    params = SamplingParams(temperature=0, max_new_tokens=10)
    requests = [
        Request([{"role": "user", "content": "Short."}], params),
        Request([{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (90, 60), (9, 99, 199))},
                                              {"type": "text", "text": "A longer question about the picture?"}]}],
                params),
        Request([{"role": "user", "content": "A medium length question, in English and 中文."}], params),
    ]
    batched = tiny_engine.generate_batch(requests)
    single = [tiny_engine.generate(r) for r in requests]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]
    assert [b.text for b in batched] == [s.text for s in single]
    assert [b.finish_reason for b in batched] == [s.finish_reason for s in single]


def test_seeded_rows_of_a_batch_sample_as_if_alone(uncached_engine):
    """Two identical seeded requests in one batch get the same answer, and the one they get
    alone: each row draws from its own generator."""
    request = Request([{"role": "user", "content": "Tell me a story."}],
                      SamplingParams(temperature=1.5, seed=5, max_new_tokens=12, ignore_eos=True))
    first, second = uncached_engine.generate_batch([request, request])
    alone = uncached_engine.generate(request)
    assert first.token_ids == second.token_ids == alone.token_ids


def test_cancel_check_stops_between_steps(tiny_engine):
    from qvl.engine import Cancelled

    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 3  # let the prefill and two decode steps through

    request = Request([{"role": "user", "content": "Count to a hundred."}],
                      SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
    events = []
    with pytest.raises(Cancelled):
        for event in tiny_engine.stream(request, cancel=cancel):
            events.append(event)
    assert len(calls) == 4 and 1 <= len(events) <= 3 and not any(isinstance(e, Done) for e in events)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.randn(3, 50)
    for row in logits:
        assert candidates(row, 0, top_p)[1].tolist() == [int(row.argmax())]
    params = SamplingParams(temperature=0.7, top_p=top_p)
    assert torch.equal(sample(logits, params), logits.argmax(-1))
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert torch.equal(sample(logits, params, gens), logits.argmax(-1))
