"""Image-feature, prefix-KV and answer caches: same outputs with and without them,
never a result computed for something else, and memory within the budgets."""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from qvl.engine import Engine, EngineOptions, Request
from qvl.kv_cache import BLOCK
from qvl.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


def fresh(engine: Engine, **options) -> Engine:
    """The same loaded model behind new caches (and options)."""
    e = engine
    return Engine(e.model, e.tokenizer, e.template, e.image_cfg, e.defaults, replace(e.options, **options),
                  e.runtime, e.path, e.load_s, e.plan)


def picture(seed: int, size=(160, 120)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def ask(image, question: str, history=(), params=GREEDY, **kw) -> Request:
    first = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}
    messages = [first, *history] if history else [first]
    return Request(messages, params, **kw)


def conversation(image):
    """The requests of a session: a question, another question, a follow-up turn, a repeat,
    and the same picture after different text (prefix differs before the image)."""
    yield ask(image, "What is in the picture?")
    yield ask(image, "Which colours dominate?")
    yield "follow-up"
    yield ask(image, "Which colours dominate?")
    yield Request([{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image},
                                                 {"type": "text", "text": "Any text?"}]}], GREEDY)


def run_session(engine: Engine, image):
    outs = []
    for request in conversation(image):
        if request == "follow-up":
            history = [{"role": "assistant", "content": outs[-1].text}, {"role": "user", "content": "And then?"}]
            request = ask(image, "Which colours dominate?", history)
        outs.append(engine.generate(request))
    return outs


def test_outputs_identical_with_caches_on_and_off(tiny_engine):
    image = picture(0)
    off = run_session(fresh(tiny_engine, vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0), image)
    on = run_session(fresh(tiny_engine), image)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    assert all(not o.timings.cached.get("prefix") and not o.timings.cached.get("answer") for o in off)
    first, second, follow_up, repeat, moved = (o.timings for o in on)
    assert first.cached == {"prefix": False, "vision": False}
    image_end = engine_spans(tiny_engine, ask(image, "Which colours dominate?"))[0][1]
    assert second.cached["prefix"] and second.reused_tokens >= image_end // BLOCK * BLOCK  # whole blocks up to the image's end
    assert follow_up.cached["prefix"] and follow_up.reused_tokens > second.reused_tokens
    assert repeat.cached == {"answer": True}
    assert moved.cached["vision"] is True  # prefix diverges before the image: features from the cache


def engine_spans(engine: Engine, request: Request) -> list[tuple[int, int, str]]:
    return engine.spans(engine.parse(request))


def test_same_pixels_any_encoding_hit_and_other_budget_misses(tiny_engine):
    engine = fresh(tiny_engine, prefix_cache_mb=0, answer_cache_entries=0)
    image = picture(1, (400, 300))
    png = io.BytesIO()
    image.save(png, format="PNG")
    engine.generate(ask(image, "Describe."))
    again = engine.generate(ask(png.getvalue(), "Describe."))  # same pixels, as PNG bytes
    assert again.timings.cached["vision"] is True
    smaller = engine.generate(ask(png.getvalue(), "Describe.", max_image_tokens=70))
    assert smaller.timings.cached["vision"] is False
    assert engine.vision_cache.stats.hits == 1 and engine.vision_cache.stats.misses == 2


def test_answer_cache_never_serves_a_different_request(tiny_engine):
    engine = fresh(tiny_engine, prefix_cache_mb=0)
    image = picture(2, (640, 480))  # 300 tokens at the default budget
    base = engine.generate(ask(image, "Describe."))
    assert engine.generate(ask(image, "Describe.")).timings.cached == {"answer": True}
    variants = [
        ask(picture(3), "Describe."),  # other pixels
        ask(image, "Describe it."),  # other text
        ask(image, "Describe.", max_image_tokens=100),  # other budget, so other pixels
        ask(image, "Describe.", params=replace(GREEDY, max_new_tokens=5)),  # other parameters
    ]
    for request in variants:
        assert not engine.generate(request).timings.cached.get("answer")
    seeded = replace(GREEDY, temperature=0.8, seed=11)
    a = engine.generate(ask(image, "Describe.", params=seeded))
    b = engine.generate(ask(image, "Describe.", params=seeded))
    assert b.timings.cached == {"answer": True} and a.token_ids == b.token_ids
    unseeded = replace(GREEDY, temperature=0.8)
    engine.generate(ask(image, "Describe.", params=unseeded))
    assert not engine.generate(ask(image, "Describe.", params=unseeded)).timings.cached.get("answer")
    assert base.text is not None


def test_other_weights_format_is_another_key(tiny_engine):
    from qvl.cache import AnswerCache

    parsed = tiny_engine.parse(ask(picture(4), "Describe."))
    a = AnswerCache.key("ckpt|int8|torch.bfloat16", parsed.ids, parsed.image_hashes, parsed.sampling)
    b = AnswerCache.key("ckpt|int4-g128|torch.bfloat16", parsed.ids, parsed.image_hashes, parsed.sampling)
    assert a != b


@pytest.mark.parametrize("budget_mb", [0.3, 0.5])  # below what the 8 pictures need in bf16 and in float32
def test_caches_stay_within_their_budgets(tiny_engine, budget_mb):
    engine = fresh(tiny_engine, vision_cache_mb=budget_mb, prefix_cache_mb=budget_mb, answer_cache_entries=3)
    limit = budget_mb * 2**20
    for seed in range(8):
        engine.generate(ask(picture(10 + seed, (320, 240)), f"Question {seed}?"))
        held = sum(size for _, size in engine.vision_cache.items.values())
        assert held == engine.vision_cache.stats.bytes <= limit
        pool = engine.prefix_cache  # the KV pool's blocks no request holds
        assert len(pool.unused) * pool.block_bytes == pool.stats.bytes <= limit
        assert len(engine.answer_cache.items) <= 3
    assert engine.vision_cache.stats.evictions > 0 and engine.prefix_cache.stats.evictions > 0
    assert engine.answer_cache.stats.evictions == 5


def test_batch_uses_the_caches(tiny_engine):
    engine = fresh(tiny_engine)
    image = picture(5)
    first = engine.generate_batch([ask(image, "One?"), ask(image, "Two?")])
    again = engine.generate_batch([ask(image, "One?"), ask(image, "Three?")])
    assert again[0].timings.cached == {"answer": True} and again[0].token_ids == first[0].token_ids
    assert again[1].timings.cached["prefix"]
    single = fresh(tiny_engine, vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0)
    assert again[1].token_ids == single.generate(ask(image, "Three?")).token_ids


def test_warm_up_runs_every_stage_without_touching_the_caches(tiny_engine):
    from dataclasses import asdict

    caches = (tiny_engine.vision_cache, tiny_engine.prefix_cache, tiny_engine.answer_cache)
    before = [asdict(c.stats) for c in caches]
    assert tiny_engine.warm_up() > 0
    assert [asdict(c.stats) for c in caches] == before
