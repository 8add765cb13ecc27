"""The one-call decode step (qvl_decode_layers) on Qwen3.5's hybrid layers: Gated DeltaNet and
gated attention, dense and mixture MLPs, against the per-layer modules, and each row's result
alone as with other rows, on every kernel tier this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qvl.kernels import build
from tests.conftest import hold_tier
from tests.test_native import _count_one_calls

TIERS = {t.name: t for t in build.tiers()} if build.compiler() else {}
pytestmark = pytest.mark.skipif(not TIERS, reason="no C compiler")
PROMPT = torch.tensor([9707, 11, 1879, 0, 1086, 15164, 872, 198, 3838, 374, 13, 42])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """preset -> a tiny Qwen3.5 checkpoint; the mixture's experts of 128, so int4 groups of 128 divide them."""
    from qvl.synth import write_checkpoint

    root = tmp_path_factory.mktemp("qwen35")
    moe = {"text_config": {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}}
    return {"qwen3.5-tiny": write_checkpoint(root / "dense", "qwen3.5-tiny", seed=3),
            "qwen3.5-tiny-moe": write_checkpoint(root / "moe", "qwen3.5-tiny-moe", seed=5, changes=moe)}


def load(checkpoint, weights: str, dtype: str | None = None):
    from qvl.engine import Engine, EngineOptions

    options = {"dtype": dtype} if dtype else {}
    return Engine.load(EngineOptions(model=str(checkpoint), weights=weights, threads=2, quant_cache=False, **options))


def prefilled(model, slots: list[int], lengths: list[int], capacity: int):
    """A cache of len(slots) rows whose recurrent states sit at pool slots `slots` (of max + 1),
    row r prefilled with the first lengths[r] prompt tokens -> (cache, last logits [B, V])."""
    from qvl.generate import new_cache
    from qvl.state_cache import StatePool

    text, t = model.language_model, model.cfg.text
    cache = new_cache(model, len(slots), capacity)
    cache.states.pool, cache.states.slots = StatePool(t, max(slots) + 1, model.dtype), torch.tensor(slots)
    logits = []
    with torch.inference_mode():
        for r, n in enumerate(lengths):
            cos, sin = model.rope(torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
            logits.append(model.logits(text(model.embed(PROMPT[None, :n]), cos, sin, cache.row(r), 0))[:, -1])
    return cache, torch.cat(logits)


def greedy(model, steps: int, slots=(2, 0, 1), lengths=(12, 9, 5)):
    """Rows prefilled at different lengths with states at `slots`, then `steps` greedy decode steps
    together -> (logits [steps, B, V], tokens [steps, B], the cache)."""
    from qvl.generate import decode_step

    cache, logits = prefilled(model, list(slots), list(lengths), max(lengths) + steps + 4)
    start, out, tokens = torch.tensor(lengths), [], []
    with torch.inference_mode():
        for step in range(steps):
            tokens.append(logits.argmax(-1))
            logits = decode_step(model, cache, tokens[-1], start + step, start + step)
            out.append(logits)
    return torch.stack(out), torch.stack(tokens), cache


def compare_paths(engine, monkeypatch, steps: int) -> None:
    """The one-call step against the per-layer modules over `steps` greedy steps of three rows:
    the same tokens; logits, keys and states within the roundings that torch's RMSNorm sums
    (in another order) can move (the GEMVs and the delta rule's and convolution's kernels are
    shared: bf16 states mostly bit for bit); in float32 within float32 rounding."""
    text = engine.model.language_model
    calls = _count_one_calls(monkeypatch)
    text.step_args = None
    logits, tokens, cache = greedy(engine.model, steps)
    assert calls == [True] * steps  # every step went through the one-call kernel
    text.step_args = False  # the per-layer path
    ref_logits, ref_tokens, ref_cache = greedy(engine.model, steps)
    text.step_args = None
    assert len(calls) == steps
    assert torch.equal(tokens, ref_tokens)
    states, ref_states = cache.states.pool, ref_cache.states.pool
    if engine.model.dtype == torch.bfloat16:  # a moved bf16 rounding shows in later steps' logits (int4: more)
        assert F.cosine_similarity(logits.flatten(0, 1), ref_logits.flatten(0, 1), dim=-1).min() > 0.99
        torch.testing.assert_close(states.recurrent, ref_states.recurrent, atol=2e-2, rtol=0)
    else:
        torch.testing.assert_close(logits, ref_logits, atol=5e-3, rtol=0)
        torch.testing.assert_close(states.recurrent, ref_states.recurrent, atol=2e-3, rtol=0)
    torch.testing.assert_close(cache.pool.keys, ref_cache.pool.keys, atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(states.conv, ref_states.conv, atol=5e-2, rtol=1e-2)


@pytest.mark.parametrize("preset,weights,dtype", [
    ("qwen3.5-tiny", "int8", None),
    pytest.param("qwen3.5-tiny", "int4", None, marks=pytest.mark.slow),
    pytest.param("qwen3.5-tiny", "bf16", None, marks=pytest.mark.slow),
    pytest.param("qwen3.5-tiny-moe", "int8", None, marks=pytest.mark.slow),
    pytest.param("qwen3.5-tiny", "int8", "fp32", marks=pytest.mark.slow),
    pytest.param("qwen3.5-tiny-moe", "int4", None, marks=pytest.mark.slow)])
def test_one_call_step_decodes_as_the_per_layer_path(checkpoints, preset, weights, dtype, monkeypatch):
    """40 greedy steps of three rows of different lengths, states at scattered slots: the same
    tokens from the one-call step as from the per-layer modules (compare_paths)."""
    compare_paths(load(checkpoints[preset], weights, dtype), monkeypatch, 40)


def rows_alone_as_together(engine, steps: int = 4) -> None:
    """Each row's logits and state, decoded alone, bit for bit those of the same row decoded
    among the others (the scheduler batches requests and relies on it)."""
    from qvl.generate import decode_step

    model = engine.model
    assert model.language_model.rows_independent()
    lengths, slots = torch.tensor([12, 7, 3]), [4, 1, 3]
    together, _ = prefilled(model, slots, lengths.tolist(), 32)
    alone = [prefilled(model, slots, lengths.tolist(), 32)[0] for _ in slots]
    tokens = torch.tensor([5, 77, 1024])
    with torch.inference_mode():
        for step in range(steps):
            logits = decode_step(model, together, tokens + step, lengths + step, lengths + step)
            for r, cache in enumerate(alone):
                row = cache.row(r)
                own = decode_step(model, row, tokens[r : r + 1] + step, lengths[r : r + 1] + step,
                                  lengths[r : r + 1] + step)
                assert torch.equal(own[0], logits[r]), (step, r)
                slot = slots[r]
                assert torch.equal(cache.states.pool.recurrent[:, slot], together.states.pool.recurrent[:, slot])
                assert torch.equal(cache.states.pool.conv[:, slot], together.states.pool.conv[:, slot])


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "qwen3.5-tiny-moe"])
def test_a_row_decodes_alone_as_among_other_rows(checkpoints, preset):
    rows_alone_as_together(load(checkpoints[preset], "int8"))


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) for name in TIERS])  # this one's: the tests above
def tier(request, monkeypatch):
    """Each tier this CPU runs, its own build chosen (the compute dtype follows it)."""
    hold_tier(monkeypatch, TIERS[request.param])
    return TIERS[request.param]


def test_every_tier_decodes_hybrid_rows_as_the_per_layer_path(checkpoints, tier, monkeypatch):
    """On each tier: the one-call step's greedy tokens those of the per-layer modules, and a row
    alone as among others (dense: a mixture's router stays float, off the GEMV, in float32)."""
    engine = load(checkpoints["qwen3.5-tiny"], "int8")
    compare_paths(engine, monkeypatch, 12)
    rows_alone_as_together(engine)
