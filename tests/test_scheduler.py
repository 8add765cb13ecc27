"""The scheduler: rows admitted while others decode, each with its own sampling, retired the
moment they finish, and answers that do not depend on what else runs, with int8 weights in
float32 (the CPUs without bf16 products) and on the default production path (bf16 compute, the
one-call native decode step). fp32 weights go through torch's GEMMs, whose rounding can follow
the row count (MKL on Zen 5 does): --deterministic covers them (the last test)."""

from __future__ import annotations

import json
import threading
import time
from collections import deque

import httpx
import pytest
import torch
from PIL import Image

from qvl.kernels.plan import default_plan
from qvl.engine import Cancelled, Engine, EngineOptions, Request
from qvl.sampling import SamplingParams
from qvl.scheduler import Sequence
from qvl.stream import Delta, Done
from tests.test_server_support import live_server

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def requests() -> list[Request]:
    """Prompts of different lengths, with and without an image, with different sampling."""
    image = Image.new("RGB", (90, 60), (9, 99, 199))
    return [
        Request([{"role": "user", "content": "Short."}], GREEDY),
        Request([{"role": "user", "content": [{"type": "image", "image": image},
                                              {"type": "text", "text": "A longer question about the picture?"}]}],
                SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=10, ignore_eos=True)),
        Request([{"role": "user", "content": "A medium length question, in English and 中文."}],
                SamplingParams(temperature=0, max_new_tokens=6, repetition_penalty=1.3, ignore_eos=True)),
        Request([{"role": "user", "content": "Tell me a story."}],
                SamplingParams(temperature=1.2, top_k=20, seed=3, max_new_tokens=14, presence_penalty=0.5,
                               ignore_eos=True)),
    ]


def uncached(checkpoint, **kw) -> Engine:
    """Without the answer and prefix caches: every request is computed, from scratch."""
    return Engine.load(EngineOptions(model=str(checkpoint), threads=2, answer_cache_entries=0, prefix_cache_mb=0,
                                     **kw))


@pytest.fixture(scope="module", params=[pytest.param("int8-fp32", marks=pytest.mark.slow), "default"])
def engine(request, tiny_checkpoint):
    if request.param == "int8-fp32":  # the float32 tiers' default: int8 weights, float32 compute
        return uncached(tiny_checkpoint, weights="int8", dtype="fp32")
    engine = uncached(tiny_checkpoint)  # int8 weights; bf16 compute where the CPU has it
    if engine.model.dtype == torch.bfloat16:
        assert engine.plan.decode_step == "qvl_decode_layers"  # the one-call native step runs
    return engine


def test_answers_do_not_depend_on_what_else_runs(engine):
    """Each request alone, then all of them admitted at staggered moments while the others
    decode: the same tokens, greedy and seeded, with penalties."""
    alone = [engine.generate(r).token_ids for r in requests()]
    outputs: dict[int, list] = {}
    seqs = [Sequence(engine.parse(r), lambda e, i=i: outputs.setdefault(i, []).append(e))
            for i, r in enumerate(requests())]
    scheduler = engine.scheduler
    for seq in seqs:  # one more request every three steps
        scheduler.submit(seq)
        for _ in range(3):
            scheduler.step()
    while not scheduler.idle:
        scheduler.step()
    together = [next(e for e in outputs[i] if isinstance(e, Done)).token_ids for i in range(len(seqs))]
    assert together == alone


def test_rows_retire_when_they_finish_and_free_their_row(engine):
    short = engine.parse(Request([{"role": "user", "content": "Hi."}], SamplingParams(temperature=0, max_new_tokens=2,
                                                                                      ignore_eos=True)))
    long = engine.parse(Request([{"role": "user", "content": "Count."}], GREEDY))
    events: dict[str, list] = {"short": [], "long": []}
    scheduler = engine.scheduler
    scheduler.submit(Sequence(long, events["long"].append))
    scheduler.submit(Sequence(short, events["short"].append))
    steps = 0
    while not any(isinstance(e, Done) for e in events["short"]):
        scheduler.step()
        steps += 1
    assert steps <= 5  # admitted at step 2, prepared, prefilled, two tokens: not held until the long one ends
    assert len(scheduler.running) == 1 and not any(isinstance(e, Done) for e in events["long"])
    while not scheduler.idle:
        scheduler.step()
    assert len(next(e for e in events["long"] if isinstance(e, Done)).token_ids) == 12


def test_cancelling_one_row_leaves_the_others_unchanged(engine):
    reqs = requests()
    alone = engine.generate(reqs[0]).token_ids
    outputs: dict[int, list] = {0: [], 1: []}
    calls = []
    cancel = lambda: calls.append(1) or len(calls) > 4  # noqa: E731
    scheduler = engine.scheduler
    scheduler.submit(Sequence(engine.parse(reqs[0]), outputs[0].append))
    scheduler.submit(Sequence(engine.parse(reqs[3]), outputs[1].append, cancel=cancel))
    while not scheduler.idle:
        scheduler.step()
    assert isinstance(outputs[1][-1], Cancelled)
    assert outputs[0][-1].token_ids == alone


def test_short_prompts_arriving_together_start_in_one_step(engine, monkeypatch):
    """Four short prompts submitted at once are all admitted and prefilled in the first step
    (the slice's leftover goes to the next in line), so every first token comes from the first
    decode step instead of one per step; the answers are still each request's own."""
    reqs = [Request([{"role": "user", "content": text}], GREEDY) for text in ("Hi.", "Why?", "Name a colour.", "1+1")]
    alone = [engine.generate(r).token_ids for r in reqs]
    outputs: dict[int, list] = {i: [] for i in range(len(reqs))}
    scheduler = engine.scheduler
    monkeypatch.setattr(scheduler, "slice_s", 10.0)  # a slice no busy CI machine overruns
    for i, r in enumerate(reqs):
        scheduler.submit(Sequence(engine.parse(r), outputs[i].append))
    scheduler.step()
    assert all(not s.prefilling for s in scheduler.running) and len(scheduler.running) == len(reqs)
    while not scheduler.idle:
        scheduler.step()
    assert [next(e for e in outputs[i] if isinstance(e, Done)).token_ids for i in range(len(reqs))] == alone


def test_prefill_slices_shrink_where_prefill_is_slow(engine):
    """While a row generates, a long prompt is prefilled in slices of about slice_s at the
    measured rate, at least 64 tokens (fewer waste the weight pass each call makes), unless the
    rate says 64 would hold the generating row longer than 0.5 s (plain AVX2 prefills ~50-70 tokens/s):
    then fewer, never under 16. Either way the answers are each request's own."""
    from qvl import scheduler as sched

    long = Request([{"role": "user", "content": " ".join(f"w{i}" for i in range(150))}], GREEDY)
    short = Request([{"role": "user", "content": "Count."}], GREEDY)
    alone = [engine.generate(r).token_ids for r in (short, long)]
    scheduler = engine.scheduler
    for rate, expected in ((1000.0, 300), (200.0, sched.MIN_SLICE_TOKENS), (50.0, 25), (10.0, 16)):
        outputs: dict[int, list] = {0: [], 1: []}
        scheduler.submit(Sequence(engine.parse(short), outputs[0].append))
        scheduler.step()  # the short one generates from here on
        seq = Sequence(engine.parse(long), outputs[1].append)
        scheduler.submit(seq)
        while seq.preparing is not None or seq.prompt is None:  # admitted, its prompt built
            scheduler.step()
        assert seq.filled == 0
        scheduler.prefill_rate = rate
        scheduler.step()
        assert seq.filled == min(expected, len(seq.prompt)), rate  # the first slice's tokens
        while not scheduler.idle:
            scheduler.step()
        assert [next(e for e in outputs[i] if isinstance(e, Done)).token_ids for i in (0, 1)] == alone, rate


def test_a_prompt_token_computes_alike_in_any_slice(engine):
    """On the default path where prefill's attention is qvl's flash kernel (AVX512-BF16, AMX
    CPUs included), a prompt prefilled in slices of 1, 3, 16 or 25 tokens leaves the same keys and values,
    to the bit, as one call, and the same last logits: a short slice takes prefill's kernels
    (many-row int8 products, the flash attention, the native RoPE), not the decode step's.
    Elsewhere prefill's attention is torch's SDPA, whose blocks follow the lengths (README)."""
    from qvl.generate import new_cache, prefill_slice
    from qvl.stream import Timings

    model = engine.model
    if default_plan(model.dtype).prefill_attention != "qvl_attention":
        pytest.skip("prefill's attention is torch's SDPA here: slices may move the last bits (--deterministic)")
    long = Request([{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}], GREEDY)
    prompt = engine.prepare(engine.parse(long), Timings())
    t = len(prompt)

    def sliced(n: int):
        cache = new_cache(model, 1, t)
        with torch.inference_mode():
            for s in range(0, t, n):
                logits = prefill_slice(model, cache, prompt, s, min(s + n, t))
        return cache.pool.keys, cache.pool.values, logits

    keys, values, logits = sliced(t)
    for n in (1, 3, 16, 25):
        k, v, last = sliced(n)
        assert all(torch.equal(a, b) for a, b in zip(k, keys)), n
        assert all(torch.equal(a, b) for a, b in zip(v, values)), n
        assert torch.equal(last, logits), n


def test_prefill_runs_the_final_layer_for_the_last_token_only(engine):
    """Prefill wants the logits of its last token only: the final layer queries, projects and
    runs its MLP for that position alone (for none in a slice inside the prompt), yet writes
    every position's keys and values, and the last hidden state is the one all positions give
    (to the bit where prefill's attention is qvl's flash kernel; within float rounding where it
    is torch's SDPA)."""
    from qvl.generate import new_cache
    from qvl.kernels.products import prompt_products
    from qvl.stream import Timings

    model = engine.model
    prompt = engine.prepare(engine.parse(Request([{"role": "user", "content": "one two three four five"}], GREEDY)),
                            Timings())
    t = len(prompt)
    h = model.embed(prompt.ids[None])
    cos, sin = model.rope(prompt.positions[:, None])
    runs = []
    for last in (None, 1, 0):
        cache = new_cache(model, 1, t)
        with torch.inference_mode(), prompt_products():
            runs.append((model.language_model(h, cos, sin, cache, 0, last=last), cache.pool.keys, cache.pool.values))
    (full, keys, values), (tail, k, v), (none, k0, v0) = runs
    assert tail.shape == (1, 1, full.shape[-1]) and none.shape == (1, 0, full.shape[-1])
    assert torch.equal(k, keys) and torch.equal(v, values) and torch.equal(k0, keys) and torch.equal(v0, values)
    if default_plan(model.dtype).prefill_attention == "qvl_attention":
        assert torch.equal(tail[0, 0], full[0, -1])
    else:
        torch.testing.assert_close(tail[0, 0].float(), full[0, -1].float(), rtol=2e-2, atol=2e-2)


def test_a_closed_stream_leaves_the_scheduler(engine):
    stream = engine.stream(Request([{"role": "user", "content": "Go on."}], GREEDY))
    assert isinstance(next(e for e in stream if isinstance(e, Delta)), Delta)
    stream.close()
    assert engine.scheduler.idle


def test_a_failing_request_fails_alone(engine, monkeypatch):
    reqs = requests()
    parsed = [engine.parse(r) for r in reqs[:2]]
    real = engine.prepare_steps

    def prepare(p, *a, **k):
        if p is parsed[1]:
            raise ValueError("this one cannot be prepared")
        return real(p, *a, **k)

    monkeypatch.setattr(engine, "prepare_steps", prepare)
    first, second = engine.generate_batch(parsed)
    assert isinstance(second, ValueError) and isinstance(first, Done) and len(first.token_ids) == 12


@pytest.mark.slow  # a `qvl serve` subprocess
def test_server_decodes_concurrent_streams_together(tiny_checkpoint):
    """Two streaming clients: the second gets tokens while the first is still generating."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 400, "temperature": 0,
            "stream": True}
    with live_server(tiny_checkpoint, "--max-batch", "2") as server:
        seen: deque[str] = deque()
        first_done = threading.Event()

        def first():
            with httpx.Client(base_url=server.url, timeout=60) as http:
                with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            seen.append("first")
            first_done.set()

        reader = threading.Thread(target=first)
        reader.start()
        while "first" not in seen:
            assert reader.is_alive()
            time.sleep(0.01)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert not first_done.is_set()  # answered while the long stream was still running
        reader.join(60)


def test_logit_bias_min_tokens_and_min_p(tiny_engine):
    """logit_bias +100 makes a token the greedy choice; min_tokens holds EOS back (EOS pushed by
    a bias, so that the random model would otherwise stop at once); min_p at 1 keeps only the most
    likely token, or the tokens tied for it (bf16 logits tie often: then any of them may be drawn)."""
    eos = tiny_engine.defaults.eos_token_ids[0]
    ask = lambda **kw: tiny_engine.generate(Request([{"role": "user", "content": "Hi."}],  # noqa: E731
                                                    SamplingParams(max_new_tokens=6, **kw)))
    assert ask(temperature=0, logit_bias=((1234, 100.0),), ignore_eos=True).token_ids == [1234] * 6
    stopped = ask(temperature=0, logit_bias=((eos, 100.0),), min_tokens=3)
    assert len(stopped.token_ids) == 4 and stopped.token_ids[-1] == eos and eos not in stopped.token_ids[:3]
    drawn = ask(temperature=1.5, seed=1, min_p=1.0, ignore_eos=True, logprobs=1).logprobs
    assert len(drawn) == 6 and all(lp.logprob == lp.top[0][1] for lp in drawn)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_engine.parse(Request([{"role": "user", "content": "Hi."}], SamplingParams(logit_bias=((10**7, 1.0),))))


def test_logprobs_come_with_the_text_they_belong_to(tiny_engine):
    request = Request([{"role": "user", "content": "Write 你好."}],
                      SamplingParams(temperature=0, max_new_tokens=10, logprobs=2, ignore_eos=True))
    events = list(tiny_engine.stream(request))
    done = events[-1]
    streamed = [lp for e in events[:-1] for lp in e.logprobs]
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    assert streamed == done.logprobs[: len(streamed)] and len(streamed) >= len(done.token_ids) - 1
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in done.logprobs)


def test_n_answers_fork_from_one_prefill_and_are_reproducible(engine):
    """n = 3 seeded: answer i is what the request alone gives with seed + i (the siblings copy
    the prefilled row, each with its own generator); a repeat gives the same three."""
    image = Image.new("RGB", (90, 60), (9, 99, 199))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Go."}]}]
    params = dict(temperature=1.0, top_k=50, max_new_tokens=8, ignore_eos=True)
    prefills = []
    real = engine.prepare_steps
    engine.prepare_steps = lambda *a, **k: prefills.append(1) or real(*a, **k)
    try:
        events = list(engine.stream(Request(messages, SamplingParams(seed=5, n=3, **params))))
    finally:
        del engine.prepare_steps
    assert len(prefills) == 1
    dones = sorted((e for e in events if isinstance(e, Done)), key=lambda d: d.index)
    assert [d.index for d in dones] == [0, 1, 2]
    for d in dones:  # each answer's deltas carry its index and add up to its text
        assert "".join(e.text for e in events if isinstance(e, Delta) and e.index == d.index) == d.text
    alone = [engine.generate(Request(messages, SamplingParams(seed=5 + i, **params))).token_ids for i in range(3)]
    assert [d.token_ids for d in dones] == alone
    assert len(set(map(tuple, alone))) > 1
    with pytest.raises(ValueError, match="max-batch"):
        engine.parse(Request(messages, SamplingParams(n=engine.scheduler.max_batch + 1)))


def test_server_n_choices_streaming_and_not(client_n):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 1.0, "seed": 3,
            "n": 2, "ignore_eos": True}
    def counted(name: str) -> int:
        return int(next(line.split()[1] for line in client_n.get("/metrics").text.splitlines()
                        if line.startswith(name + " ")))

    prompts, completions = counted("qvl_prompt_tokens_total"), counted("qvl_completion_tokens_total")
    r = client_n.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["completion_tokens"] == 8
    assert counted("qvl_prompt_tokens_total") - prompts == r["usage"]["prompt_tokens"]  # once, not per answer
    assert counted("qvl_completion_tokens_total") - completions == 8
    chunks = [json.loads(line[6:]) for line in client_n.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ).text.splitlines() if line.startswith("data: {")]
    for i in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == i)
        assert text == r["choices"][i]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.fixture
def client_n(tiny_engine):
    from fastapi.testclient import TestClient

    from tests.test_server_api import make_app, wait_ready

    with TestClient(make_app(tiny_engine)) as c:
        wait_ready(c)
        yield c


def _pool_engine(checkpoint, blocks: int, dtype: str = "fp32") -> Engine:
    """An uncached int8 engine (float32 compute, or the default's) whose KV pool holds `blocks` blocks."""
    from qvl.kv_cache import BLOCK
    from qvl.scheduler import kv_bytes_per_position

    kw = {"dtype": dtype} if dtype == "fp32" else {}
    probe = uncached(checkpoint, weights="int8", kv_cache_mb=1, **kw)
    mb = blocks * BLOCK * kv_bytes_per_position(probe.model) / 2**20
    return uncached(checkpoint, weights="int8", kv_cache_mb=mb, **kw)


def _run_all(engine: Engine, reqs: list[Request]) -> tuple[list[list], int]:
    """Submit all, step until idle: each request's events and the most requests running at once."""
    outputs: dict[int, list] = {i: [] for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        engine.scheduler.submit(Sequence(engine.parse(r), outputs[i].append))
    most = 0
    while not engine.scheduler.idle:
        engine.scheduler.step()
        most = max(most, len(engine.scheduler.running))
    return [outputs[i] for i in range(len(reqs))], most


def test_a_small_kv_pool_makes_requests_wait_then_complete(tiny_checkpoint):
    """A pool with room for one request's prompt and answer: the second waits (never fails)
    until the first leaves, then runs; both answer as they would alone. One that can never fit
    gets a RequestError naming max_tokens when it is parsed."""
    from qvl.engine import RequestError
    from qvl.kv_cache import BLOCK, blocks_for

    filler = " ".join(["word"] * 30)
    reqs = [Request([{"role": "user", "content": f"Question {i}? {filler}"}], GREEDY) for i in range(2)]
    probe = uncached(tiny_checkpoint, weights="int8", dtype="fp32")
    lengths = [len(probe.parse(r).ids) for r in reqs]
    need = max(blocks_for(n + GREEDY.max_new_tokens) for n in lengths)
    assert min(blocks_for(n) for n in lengths) * 2 > need  # two prompts never fit together
    engine = _pool_engine(tiny_checkpoint, need)
    alone = [engine.generate(r).token_ids for r in reqs]
    events, most = _run_all(engine, reqs)
    assert most == 1 and engine.scheduler.preemptions == 0
    assert [e[-1].token_ids for e in events] == alone
    too_long = Request([{"role": "user", "content": "Hi."}], SamplingParams(max_new_tokens=4 * need * BLOCK))
    with pytest.raises(RequestError, match="kv-cache-mb") as info:
        engine.parse(too_long)
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize("seeded,dtype", [pytest.param(False, "fp32", marks=pytest.mark.slow),
                                          pytest.param(True, "fp32", marks=pytest.mark.slow), (True, "default")])
def test_a_full_pool_preempts_the_newest_and_recomputes_it_to_the_same_tokens(tiny_checkpoint, seeded, dtype):
    """Two requests whose prompts fit together but whose answers do not: the newer is taken
    out when the older needs a block, waits, is prefilled again and replays its tokens; every
    request ends with the tokens it gives alone, its streamed text adds up to its answer (no
    token sent twice), and none fails."""
    from qvl.kv_cache import blocks_for

    params = SamplingParams(temperature=0.9, seed=4, max_new_tokens=40, ignore_eos=True) if seeded else \
        SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    reqs = [Request([{"role": "user", "content": f"Question {i}?"}], params) for i in range(2)]
    probe = uncached(tiny_checkpoint, weights="int8", dtype="fp32")
    lengths = [len(probe.parse(r).ids) for r in reqs]
    whole = max(blocks_for(n + params.max_new_tokens) for n in lengths)
    assert sum(blocks_for(n) for n in lengths) <= whole + 1 < 2 * whole
    engine = _pool_engine(tiny_checkpoint, whole + 1, dtype)
    alone = [engine.generate(r).token_ids for r in reqs]
    events, most = _run_all(engine, reqs)
    assert most == 2 and engine.scheduler.preemptions >= 1
    for got, want in zip(events, alone):
        done = got[-1]
        assert isinstance(done, Done) and done.token_ids == want
        assert "".join(e.text for e in got if isinstance(e, Delta)) == done.text
    assert engine.scheduler.pool.held == 0  # every block came back


def test_rows_share_blocks_n_siblings_and_a_running_prefix(tiny_checkpoint):
    """n = 3 answers hold their prompt's full blocks once (each copies only the partial last
    block before writing); a request that begins like a running one (same picture, other
    question) shares that one's blocks instead of computing them, and answers as it would alone."""
    from qvl.kv_cache import BLOCK, blocks_for

    image = Image.new("RGB", (160, 120), (9, 99, 199))
    ask = lambda q, **kw: Request([{"role": "user", "content": [{"type": "image", "image": image},  # noqa: E731
                                                                {"type": "text", "text": q}]}],
                                  SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, **kw))
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, answer_cache_entries=0,
                                       weights="int8", dtype="fp32"))
    scheduler, pool = engine.scheduler, engine.scheduler.pool
    parsed = engine.parse(ask("Go.", n=3, seed=1))
    scheduler.submit(Sequence(parsed, lambda e: None))
    while not any(s.index == 2 for s in scheduler.running):  # until the fork
        scheduler.step()
    full = len(parsed.ids) // BLOCK
    shared = scheduler.running[0].blocks[:full]
    assert all(pool.refs[b] == 3 for b in shared)
    assert pool.held <= full + 3 * (blocks_for(len(parsed.ids) + 1) - full)
    other = ask("What colour is it?")
    later: list = []
    scheduler.submit(Sequence(engine.parse(other), later.append))
    scheduler.step()
    newcomer = scheduler.running[-1]
    assert newcomer.blocks[:4] == shared[:4] and pool.refs[shared[0]] == 4  # the image's blocks, shared
    while not scheduler.idle:
        scheduler.step()
    assert later[-1].timings.reused_tokens >= 4 * BLOCK
    fresh = uncached(tiny_checkpoint, weights="int8", dtype="fp32")
    assert later[-1].token_ids == fresh.generate(other).token_ids
    assert pool.held == 0 and pool.stats.bytes > 0  # what is left is prefix cache


def test_deterministic_offers_only_whole_chunks_for_reuse(tiny_checkpoint):
    """--deterministic: of a prompt between one and two prefill chunks long, only the blocks of
    the whole first chunk become shareable (the rest was computed in a shorter chunk, in other
    products than a longer prompt's prefill would use)."""
    from qvl.kv_cache import BLOCK
    from qvl.scheduler import DETERMINISTIC_CHUNK

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, answer_cache_entries=0,
                                       deterministic=True, weights="int8", dtype="fp32"))
    request = Request([{"role": "user", "content": " ".join(["word"] * 200)}], GREEDY)
    assert DETERMINISTIC_CHUNK + 2 * BLOCK < len(engine.parse(request).ids) < 2 * DETERMINISTIC_CHUNK
    engine.generate(request)
    assert len(engine.scheduler.pool.hash_of) == DETERMINISTIC_CHUNK // BLOCK


@pytest.mark.parametrize("weights", [pytest.param("fp32", marks=pytest.mark.slow), "default"])
def test_deterministic_answers_do_not_depend_on_slices_or_reused_prefixes(tiny_checkpoint, weights):
    """--deterministic: a request that reuses another's prefix (same photo, other question), a
    second turn after the first, and a request prefilled in small slices beside generating
    rows all give the tokens of a fresh engine that reuses nothing, and their logprobs to the
    last bit (without the option those differ in the last bits: reused keys and values were
    computed in other slices)."""
    exact = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=0)
    same = lambda a, b: [(x.token_id, x.logprob) for x in a.logprobs] == [(x.token_id, x.logprob)  # noqa: E731
                                                                          for x in b.logprobs]
    kw = dict(deterministic=True, **({"weights": "fp32"} if weights == "fp32" else {}))
    fresh = uncached(tiny_checkpoint, **kw)
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2, answer_cache_entries=0, **kw))
    photo = Image.fromarray((torch.rand(480, 640, 3) * 255).to(torch.uint8).numpy())

    def ask(question, history=()):
        content = [{"type": "image", "image": photo}, {"type": "text", "text": question}]
        return Request([*history, {"role": "user", "content": content}] if not history else
                       [*history, {"role": "user", "content": question}], exact)

    first = engine.generate(ask("Describe this photo."))
    other = engine.generate(ask("What colour is the sky in it?"))
    assert other.timings.reused_tokens >= 128  # the photo's tokens came from the first request
    assert same(other, fresh.generate(ask("What colour is the sky in it?")))
    history = [{"role": "user", "content": [{"type": "image", "image": photo},
                                            {"type": "text", "text": "Describe this photo."}]},
               {"role": "assistant", "content": first.text}]
    second = engine.generate(ask("And the ground?", history))
    assert second.timings.reused_tokens >= 128
    assert same(second, fresh.generate(ask("And the ground?", history)))
    # prefilled in slices while another row generates (the slice size follows the measured rate)
    outputs: dict[int, list] = {0: [], 1: []}
    engine.scheduler.prefill_rate = 200.0  # slices of 50 tokens: aligned to whole chunks all the same
    engine.scheduler.submit(Sequence(engine.parse(Request([{"role": "user", "content": "Count."}], GREEDY)),
                                     outputs[0].append))
    engine.scheduler.step()
    engine.scheduler.submit(Sequence(engine.parse(ask("A third question?")), outputs[1].append))
    while not engine.scheduler.idle:
        engine.scheduler.step()
    assert same(outputs[1][-1], fresh.generate(ask("A third question?")))
