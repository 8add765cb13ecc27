"""Threads on a shared machine: the kernels' team hands every piece of work out once and takes
over a stopped thread's, decoding gives the same bits on 1, 2 or 3 threads on every tier, and
torch's own ops follow the cores other programs leave free."""

from __future__ import annotations

import os

import pytest
import torch

from qvl import paths
from qvl.kernels import build
from qvl.kernels.library import library
from qvl.threads import (MEASURE_S, CpuTimes, Load, Placement, Threads, kernel_threads, placement, prompt_threads,
                         read_cpu_times, torch_threads)
from tests.conftest import hold_tier

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
    hold_tier(monkeypatch, TIERS[request.param])
    return TIERS[request.param]


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
    if not engine.model.language_model.rows_independent():  # float32 compute keeps a mixture's router in float
        pytest.skip("the one-call step does not take this model on this tier")
    torch.set_num_threads(1)
    alone = decoded(engine)
    for count in (2, 3):
        torch.set_num_threads(count)
        for got, want in zip(decoded(engine), alone):
            assert torch.equal(got, want), (tier.name, preset, weights, count)


def test_torch_gets_the_cores_other_programs_leave(threads):
    """One thread fewer for each core other programs keep busy (from 0.3 of one), at least one,
    measured over the last second of readings; the kernels keep the engine's count inside a step
    while torch's own ops run on fewer, and a prompt's kernels run on one more for each such core;
    --threads fixes all three."""
    assert [torch_threads(2, busy) for busy in (0.0, 0.2, 0.5, 1.0, 1.9)] == [2, 2, 1, 1, 1]
    assert [torch_threads(8, busy) for busy in (0.25, 0.6, 2.2, 9.0)] == [8, 7, 6, 1]
    assert [prompt_threads(2, busy) for busy in (0.0, 0.2, 0.5, 1.0, 1.9)] == [2, 2, 3, 3, 4]
    readings = iter([CpuTimes(0.0, 0.0), CpuTimes(0.25, 0.0), CpuTimes(0.5, 0.0), CpuTimes(1.25, 0.6),
                     CpuTimes(2.5, 0.7), CpuTimes(2.75, 0.7)])
    load = Load(read=lambda: next(readings))
    count = Threads(2, load)
    for _ in range(3):  # 0.6 s of other programs' CPU over the last second (from 0.25 s to 1.25 s)
        load.sample()
    assert load.busy == pytest.approx(0.6)
    with count.step():
        assert (count.torch, torch.get_num_threads(), kernel_threads()) == (1, 1, 2)
        with count.prompt():
            assert (kernel_threads(), count.stats()["qvl_threads_prompt"]) == (3, 3)
        assert kernel_threads() == 2
    assert kernel_threads() == 1  # outside a step the kernels follow torch's count (a test's, a tool's)
    load.sample(), load.sample()  # 0.1 s over the last 1.5 s: quiet again
    assert load.busy == pytest.approx(0.1 / 1.5)
    with count.step(), count.prompt():
        assert (count.torch, torch.get_num_threads(), kernel_threads()) == (2, 2, 2)
    fixed = Threads(2, None)
    with fixed.step(), fixed.prompt():
        assert (fixed.torch, kernel_threads(), fixed.stats()["qvl_cpu_cores_busy_elsewhere"]) == (2, 2, 0.0)


def test_threads_get_cores_of_their_own_the_engines_away_from_other_programs():
    """While a core is busy, each pool thread is pinned to a core of its own: the engine's thread
    (0) on a core no other program uses, the prompt's extra threads on the shared cores; it moves
    when the engine's core turns out to be the shared one, not when the other program is seen on
    every core; once quiet, every thread may run anywhere again; never while torch's ops run on
    more than one thread (libgomp would restart the threads its smaller regions leave out on the
    engine's core)."""
    a, b, c = (0,), (1,), (2, 3)  # three cores, the third with two hardware threads
    assert placement([a, b], 2, {1}) == [a, b]
    assert placement([a, b], 3, {1}) == [a, b, b]  # the extra thread takes a share of the shared core
    assert placement([a, b], 3, {0}) == [b, a, a]
    assert placement([a, b], 3, set()) == [a, b, a]
    assert placement([a, b, c], 4, {0}) == [b, c, a, a]

    placed, busy = [], {0: 0, 1: 0}
    place = Placement([a, b], lambda wanted: placed.append(wanted) or [-1, -2, -3][:len(wanted)],
                      read=lambda cpus: dict(busy))
    place.update(0.1, 2, 1)
    assert placed == [] and place.pinned is None  # quiet: left to the OS
    place.update(1.0, 3, 1)
    main = place.pinned[0]
    assert placed[-1] == place.pinned and len(set(place.pinned[:2])) == 2 and place.pinned[2] != main

    def a_second_later(on_main: float, on_other: float) -> None:
        """Other programs' share of each core over the next measure (the pinned threads use none)."""
        hz = os.sysconf("SC_CLK_TCK")
        when, cpus, ticks = place.since
        place.since = (when - MEASURE_S, cpus, ticks)
        other = b if main == a else a
        busy[main[0]] += round(on_main * MEASURE_S * hz)
        busy[other[0]] += round(on_other * MEASURE_S * hz)

    a_second_later(0.5, 0.5)  # a program the OS moves between both cores: no move
    place.update(1.0, 3, 1)
    assert len(placed) == 1
    a_second_later(0.0, 0.9)  # the other core is the busy one: where it should be
    place.update(1.0, 3, 1)
    assert len(placed) == 1
    a_second_later(0.9, 0.0)  # the engine's core is the busy one: the threads move
    place.update(1.0, 3, 1)
    assert len(placed) == 2 and place.pinned[0] != main and place.pinned[2] == main
    place.update(0.0, 3, 1)
    assert place.pinned is None and len(placed) == 2
    place.update(1.0, 4, 2)  # torch on two threads (more than one free core): not pinned
    assert place.pinned is None and len(placed) == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
@needs_native
def test_the_pool_threads_are_pinned_and_released(threads):
    """place_team pins thread t of this thread's pool (the one qvl's kernels and torch's ops run on)
    to the CPUs asked; Placement.release lets them run anywhere again."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:2]
    torch.set_num_threads(2)
    tids = library().place_team([(cpus[1],), (cpus[0],)])
    try:
        assert tids is not None and len(set(tids)) == 2
        assert [os.sched_getaffinity(tid) for tid in tids] == [{cpus[1]}, {cpus[0]}]
    finally:
        place = Placement([(c,) for c in allowed], library().place_team)
        place.tids = tids or []
        place.release()
    assert [os.sched_getaffinity(tid) for tid in tids] == [set(allowed)] * 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
@needs_native
def test_the_callers_thread_is_let_go_once_the_engine_has_nothing_to_run(tiny_checkpoint, threads):
    """While another program keeps a core busy, the engine pins its pool's threads, the caller's
    among them (it drives the scheduler); once its requests are answered, the caller's thread may
    run on every CPU again: a program using qvl as a library is not left on one core."""
    from qvl.engine import Engine, EngineOptions, Request
    from qvl.sampling import SamplingParams
    from qvl.threads import team_placement

    allowed = os.sched_getaffinity(0)
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2))
    busy = Load(read=lambda: None)
    busy.busy = 1.0  # another program on one core
    engine.threads = Threads(2, busy, team_placement(2))
    request = Request([{"role": "user", "content": "Count to ten."}],
                      SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    try:
        during = [os.sched_getaffinity(0) for _ in engine.stream(request)]
        assert len(during[0]) == 1 < len(allowed)  # while answering: on one core of its own
        assert os.sched_getaffinity(0) == allowed and engine.threads.placement.pinned is None
    finally:
        os.sched_setaffinity(0, allowed)  # (the next tests' CPUs, whatever happened)
        engine.close()


def test_other_programs_cpu_time_leaves_out_niced_ones(tmp_path):
    """/proc/stat's user, system, irq, softirq and steal time of this process's CPUs count as
    other programs' (less this process's own); the nice column, processes that give way, does not."""
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    line = "cpu{} {user} {nice} 0 500 0 0 0 {steal} 0 0"
    stat.write_text("\n".join(["cpu  0 0 0 0 0 0 0 0 0 0", line.format(0, user=2 * hz, nice=0, steal=0),
                               line.format(1, user=0, nice=50 * hz, steal=hz), line.format(7, user=90 * hz, nice=0,
                                                                                            steal=0), "intr 5"]))
    ours = sum(os.times()[:2])
    times = read_cpu_times(stat, cpus=[0, 1])
    assert 3.0 - ours - 0.05 <= times.others <= 3.0  # cpu7 is not ours; the nice column does not count
    assert read_cpu_times(tmp_path / "missing") is None


@pytest.fixture(scope="module", params=[pytest.param(name, marks=() if name == RUNS else pytest.mark.slow)
                                        for name in TIERS])
def tier_lib(request):
    """Each tier's kernels (built once into qvl's own folder)."""
    tier = TIERS[request.param]
    return tier, build.load(tier, paths.cache_root() / "native")


def same_bits_on_1_2_3_threads(name: str, op) -> None:
    torch.set_num_threads(1)
    alone = op()
    if alone is None:
        return  # not built for this tier
    alone = [alone] if isinstance(alone, torch.Tensor) else list(alone)
    for count in (2, 3):
        torch.set_num_threads(count)
        got = op()
        got = [got] if isinstance(got, torch.Tensor) else list(got)
        assert all(torch.equal(a, b) for a, b in zip(got, alone)), (name, count)


def test_prompt_kernels_give_the_same_bits_on_any_number_of_threads(tier_lib, threads):
    """The prompt's and the vision tower's kernels whose rows, heads and channels the threads take
    in turn: RMSNorm (plain, zero-centred, gated), SiLU.mul, the text and vision RoPE, flash,
    byte-code and 16-bit attention (keys and values packed head by head), the delta rule in runs
    of heads and its convolution in runs of channels, the dequantisation, the byte kernel's int8
    and int4 products (with the vision tower's fusions), oneDNN's int8 passes and the GEMV's
    activation codes at 40 rows: the same bits on 1, 2 and 3 threads."""
    from qvl.kernels import attention, delta_rule, elementwise, linear
    from qvl.quantize import pack_nibbles, quantize_int4

    tier, lib = tier_lib
    torch.manual_seed(8)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, z = torch.randn(300, 256).to(dtype), torch.randn(256).to(dtype), torch.randn(300, 256).to(dtype)
        same_bits_on_1_2_3_threads("rmsnorm", lambda: elementwise.rms_norm(lib, x, w, 1e-6))
        same_bits_on_1_2_3_threads("zero-centred", lambda: elementwise.rms_norm(lib, x, w, 1e-6, zero_centred=True))
        same_bits_on_1_2_3_threads("gated", lambda: elementwise.gated_rms_norm(lib, x, z, w, 1e-6))
        same_bits_on_1_2_3_threads("silu_mul", lambda: elementwise.silu_mul(lib, x.clone(), z))
        q, cos, sin = torch.randn(1, 4, 100, 64).to(dtype), torch.randn(1, 1, 100, 64).to(dtype), \
            torch.randn(1, 1, 100, 64).to(dtype)
        same_bits_on_1_2_3_threads("text rope", lambda: elementwise.text_rope(lib, q, cos, sin))
        g, beta = -torch.rand(70, 4), torch.rand(70, 4)
        qk, v = torch.randn(70, 2, 32).to(dtype), torch.randn(70, 4, 32).to(dtype)
        state = torch.randn(4, 32, 32)
        same_bits_on_1_2_3_threads("delta rule", lambda: (lambda s: (delta_rule.native_gated_delta_rule(
            lib, qk, qk, v, g, beta, s, 5), s))(state.clone()))
        conv_x, conv_w, conv_s = torch.randn(70, 600).to(dtype), torch.randn(600, 4).to(dtype), torch.randn(600, 3)
        same_bits_on_1_2_3_threads("causal conv", lambda: (lambda s: (delta_rule.native_causal_conv(
            lib, conv_x, conv_w, s), s))(conv_s.to(dtype).clone()))
        q8, s8 = torch.randint(-127, 128, (300, 256), dtype=torch.int8), torch.rand(300).to(dtype)
        same_bits_on_1_2_3_threads("dequantize int8", lambda: linear.dequantize(lib, build.W_INT8, q8, s8, None, 0,
                                                                               (300, 256)))
        q4, s4, z4 = quantize_int4(torch.randn(300, 256), 64)
        same_bits_on_1_2_3_threads("dequantize int4", lambda: linear.dequantize(
            lib, build.W_INT4, pack_nibbles(q4), s4.to(dtype), z4.to(dtype), 64, (300, 256)))
        same_bits_on_1_2_3_threads("gemv of 40 rows", lambda: linear.gemv(lib, build.W_INT8, x[:40], q8, 300,
                                                                          s8, bias=s8))
        if lib.qvl_q8_levels():  # the byte kernel: its row blocks' codes, then (rows, column tile) items
            qb, sb, res = q8[:272].contiguous(), s8[:272].contiguous(), z[:, :1].expand(300, 272).contiguous()
            n4, s4b, z4b = pack_nibbles(q4[:272]), s4[:272].to(dtype).contiguous(), z4[:272].to(dtype).contiguous()
            products = {"byte products": lambda: linear.q8_linear(lib, x, qb, sb, sb, gelu_tanh=True, residual=res,
                                                                  layer_norm=(w, z[0].contiguous(), 1e-6)),
                        "int4 byte products": lambda: linear.q4_linear(lib, x, n4, s4b, z4b, 64)}
            for name, op in products.items():
                assert op() is not None, name
                same_bits_on_1_2_3_threads(name, op)
    xb = torch.randn(200, 8, 64).bfloat16()
    vc, vs = torch.randn(200, 1, 64), torch.randn(200, 1, 64)
    same_bits_on_1_2_3_threads("vision rope", lambda: elementwise.vision_rope(lib, xb, vc, vs))
    kv = torch.randn(200, 2, 64).bfloat16()
    same_bits_on_1_2_3_threads("flash attention", lambda: attention.attention(lib, xb, kv, kv, causal_from=0))
    same_bits_on_1_2_3_threads("byte attention", lambda: attention.attention_q8(lib, xb, xb, xb))
    xf = torch.randn(200, 4, 64)
    same_bits_on_1_2_3_threads("16-bit attention", lambda: attention.attention_i16(lib, xf, xf, xf))
    if not library().int8_levels:
        return  # no exact int8 GEMM in this torch
    packed = linear.pack_int8(q8)
    colsums = q8.float().sum(1)
    for levels in (127, 255):
        same_bits_on_1_2_3_threads("int8 passes", lambda: linear.int8_matmul(lib, x.float(), packed, colsums,
                                                                             s8.float(), None, levels))
