"""Threads on a shared machine: the kernels' team hands every piece of work out once and takes
over a stopped thread's, and decoding gives the same bits on 1, 2 or 3 threads on every tier."""

from __future__ import annotations

import pytest
import torch

from qvl import paths
from qvl.kernels import build
from qvl.kernels import library as library_module
from qvl.kernels.library import Library, library

TIERS = {t.name: t for t in build.tiers()} if build.compiler() else {}
RUNS = build.select_tier().name if TIERS else None
needs_native = pytest.mark.skipif(not TIERS or library().lib is None, reason="no native kernels")
PROMPT = torch.tensor([9707, 11, 1879, 0, 1086, 15164, 872, 198, 3838, 374, 13, 42])


@pytest.fixture
def threads():
    """torch's thread count, put back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def team_check(threads: int, items: int, jobs: int, takeover: bool, stall_ms: int) -> tuple[int, list, list]:
    commits, results = torch.zeros(items, dtype=torch.int64), torch.zeros(items, dtype=torch.int64)
    taken = library().lib.qvl_team_check(threads, items, jobs, int(takeover), stall_ms, commits.data_ptr(),
                                         results.data_ptr())
    return taken, commits.tolist(), results.tolist()


@needs_native
@pytest.mark.parametrize("takeover", [True, False])
@pytest.mark.parametrize("team", [1, 2, 3])
def test_every_item_is_done_once_when_a_thread_stops(team, takeover):
    """The first thread to reach item 0 stops there (its core taken by another program) until
    another thread has committed it, or for 50 ms: the job's items are each committed exactly
    once with their own result, whatever the threads; with a second thread, item 0 of a takeover
    job (a product, attention) is taken over rather than waited for (a minute at most: this
    machine's other work may hold the other threads up); an in-place job (the delta rule's
    states) waits for it instead."""
    taken, commits, results = team_check(team, 1000, 3, takeover, 60000 if takeover and team > 1 else 50)
    assert commits == [3] * 1000 and results == list(range(1, 1001))
    assert taken >= 1 if takeover and team > 1 else taken == 0
    taken, commits, _ = team_check(team, 7, 50, takeover, 0)  # fewer items than some shares: many short jobs
    assert commits == [50] * 7


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Qwen3-VL (dense, and a mixture with experts of 128) and Qwen3.5 (Gated DeltaNet) checkpoints."""
    from qvl.synth import write_checkpoint

    root = tmp_path_factory.mktemp("threads")
    return {"tiny": write_checkpoint(root / "tiny", "tiny", seed=1),
            "tiny-moe": write_checkpoint(root / "moe", "tiny-moe", seed=4,
                                         changes={"text_config": {"moe_intermediate_size": 128}}),
            "qwen3.5-tiny": write_checkpoint(root / "qwen35", "qwen3.5-tiny", seed=3)}


@pytest.fixture(params=[pytest.param(name, marks=() if name == RUNS else pytest.mark.slow) for name in TIERS])
def tier(request, monkeypatch):
    """Each tier this CPU runs, its own build chosen (the compute dtype follows it)."""
    t = TIERS[request.param]
    monkeypatch.setenv("QVL_ISA", t.name)
    monkeypatch.setattr(library_module, "_chosen", [Library(t, build.load(t, paths.cache_root() / "native"))])
    return t


def decoded(engine, steps: int = 4) -> list[torch.Tensor]:
    """Three rows prefilled at different lengths, then `steps` greedy decode steps together:
    the logits, the keys and values and (hybrid) the recurrent and convolution states."""
    from qvl.generate import decode_step, new_cache

    model, lengths = engine.model, [12, 9, 5]
    text, cache = model.language_model, new_cache(model, 3, 24)
    with torch.inference_mode():
        logits = []
        for r, n in enumerate(lengths):
            cos, sin = model.rope(torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
            logits.append(model.logits(text(model.embed(PROMPT[None, :n]), cos, sin, cache.row(r), 0))[:, -1])
        logits, out, start = torch.cat(logits), [], torch.tensor(lengths)
        for step in range(steps):
            logits = decode_step(model, cache, logits.argmax(-1), start + step, start + step)
            out.append(logits)
    states = [cache.states.pool.recurrent, cache.states.pool.conv] if cache.states is not None else []
    return [torch.stack(out), cache.pool.keys, cache.pool.values, *states]


@pytest.mark.parametrize("preset,weights", [("tiny", "int8"), ("tiny", "int4"), ("qwen3.5-tiny", "int8"),
                                            pytest.param("tiny-moe", "int8", marks=pytest.mark.slow),
                                            pytest.param("tiny", "bf16", marks=pytest.mark.slow)])
def test_decoding_gives_the_same_bits_on_any_number_of_threads(checkpoints, preset, weights, tier, threads):
    """The one-call decode step (its products, attention and delta rule taken by the threads in
    turn) and the prompt's products: the same logits, cache and states, bit for bit, on 1, 2 and
    3 threads (more threads than this machine's cores: some wait, others take their work over)."""
    from qvl.engine import Engine, EngineOptions

    engine = Engine.load(EngineOptions(model=str(checkpoints[preset]), weights=weights, threads=1, quant_cache=False))
    assert engine.model.language_model.rows_independent()  # the one-call step runs
    torch.set_num_threads(1)
    alone = decoded(engine)
    for count in (2, 3):
        torch.set_num_threads(count)
        for got, want in zip(decoded(engine), alone):
            assert torch.equal(got, want), (tier.name, preset, weights, count)
