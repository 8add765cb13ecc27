"""Gated DeltaNet's ops (gated_delta_rule, gated_delta_step, causal_conv, causal_conv_step), in
torch and natively on every kernel tier this machine can run: against transformers' torch
reference, against each other, and the invariances the model's caches rely on (prefill slices
at multiples of CHUNK, decode after prefill, rows of a batch)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from qvl import paths
from qvl.kernels import build, ops
from qvl.kernels import delta_rule as dr
from qvl.kernels.delta_rule import CHUNK, chunk_bounds
from qvl.kernels.library import library
from qvl.kernels.plan import default_plan

TIERS = build.tiers() if build.compiler() else []
RUNS = library().tier.name if library().lib is not None else None  # the others' builds are slow
OPS = ("gated_delta_rule", "gated_delta_step", "causal_conv", "causal_conv_step")


def _native(lib, name):
    """The native op `name` on `lib`, which must take the test's inputs."""
    def call(*args):
        out = getattr(dr, f"native_{name}")(lib, *args)
        assert out is not None, f"{name} declined the inputs"
        return out
    return call


@pytest.fixture(scope="module", params=["torch"] + [
    pytest.param(t.name, marks=() if t.name == RUNS else pytest.mark.slow) for t in TIERS])
def impl(request):
    """The four ops: the torch reference, or one tier's native kernels."""
    if request.param == "torch":
        return SimpleNamespace(**{name: getattr(dr, f"reference_{name}") for name in OPS})
    lib = build.load(next(t for t in TIERS if t.name == request.param), paths.cache_root() / "native")
    return SimpleNamespace(**{name: _native(lib, name) for name in OPS})

HK, HV, DK, DV = 2, 4, 32, 48  # grouped: value head h reads key head h // 2


def _inputs(t: int, dtype: torch.dtype = torch.float32, rows: tuple[int, ...] = ()):
    """q, k, v (not normalised, in `dtype`), g (log decay <= 0) and beta in (0, 1) for t tokens
    (rows: leading batch dims instead of t)."""
    lead = rows or (t,)
    q, k = (torch.randn(*lead, HK, DK).to(dtype) for _ in range(2))
    v = torch.randn(*lead, HV, DV).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(*lead, HV)) * 0.3
    beta = torch.rand(*lead, HV)
    return q, k, v, g, beta


def _transformers(fn, q, k, v, g, beta, state, **kw):
    """transformers' delta rule on one row: -> (out [T, Hv, Dv], final state [Hv, Dk, Dv])."""
    out, final = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None].clone(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return out[0], final[0]


def test_chunk_bounds_fall_on_absolute_multiples():
    assert chunk_bounds(0, 2 * CHUNK + 5) == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 2 * CHUNK + 5)]
    assert chunk_bounds(CHUNK - 3, CHUNK) == [(0, 3), (3, CHUNK)]
    assert chunk_bounds(7, 0) == []


@pytest.mark.parametrize("offset", [0, 37])
def test_prefill_matches_transformers(impl, offset):
    t = 2 * CHUNK + 45
    q, k, v, g, beta = _inputs(t)
    state = torch.randn(HV, DK, DV) * 0.1
    ours_state = state.clone()
    out = impl.gated_delta_rule(q, k, v, g, beta, ours_state, offset)
    for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ref_out, ref_state = _transformers(fn, q, k, v, g, beta, state)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ours_state, ref_state, atol=2e-5, rtol=1e-4)


def test_prefill_bf16_inputs_give_bf16_out_near_float(impl):
    q, k, v, g, beta = _inputs(CHUNK + 9, torch.bfloat16)
    s16, s32 = torch.zeros(HV, DK, DV), torch.zeros(HV, DK, DV)
    out = impl.gated_delta_rule(q, k, v, g, beta, s16, 0)
    ref = impl.gated_delta_rule(q.float(), k.float(), v.float(), g, beta, s32, 0)
    assert out.dtype == torch.bfloat16 and out.shape == (CHUNK + 9, HV, DV)
    assert torch.equal(out, ref.bfloat16()) and torch.equal(s16, s32)  # bf16 only at the edges


@pytest.mark.parametrize("offset", [0, 2 * CHUNK])
def test_prefill_slices_at_chunk_multiples_are_bit_identical(impl, offset):
    """One call == slices ending at absolute multiples of CHUNK == resuming from the state at
    such a multiple (outputs and states, bit for bit)."""
    t = 3 * CHUNK + 21
    q, k, v, g, beta = _inputs(t)
    whole = torch.randn(HV, DK, DV) * 0.1
    start = whole.clone()
    out = impl.gated_delta_rule(q, k, v, g, beta, whole, offset)
    sliced, parts, snapshot = start.clone(), [], None
    for a, b in ((0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, t)):
        parts.append(impl.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], sliced, offset + a))
        if b == 2 * CHUNK:
            snapshot = sliced.clone()
    assert torch.equal(torch.cat(parts), out) and torch.equal(sliced, whole)
    resumed = impl.gated_delta_rule(*(x[2 * CHUNK :] for x in (q, k, v, g, beta)), snapshot, offset + 2 * CHUNK)
    assert torch.equal(resumed, out[2 * CHUNK :]) and torch.equal(snapshot, whole)


def test_decode_steps_after_a_prefill_continue_it(impl):
    """Prefill of n tokens, then one step per token (row 1 of a pool of 3 slots, beside
    another row) ~ one prefill of all of them; a slot no row names is untouched."""
    n, extra = CHUNK + 5, 6
    q, k, v, g, beta = _inputs(n + extra)
    one = torch.zeros(HV, DK, DV)
    whole = impl.gated_delta_rule(q, k, v, g, beta, one, 0)
    states = torch.zeros(3, HV, DK, DV)
    first = impl.gated_delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n], states[1], 0)
    other = _inputs(0, rows=(extra, 1))
    outs = []
    for i in range(n, n + extra):
        rows = [torch.cat([x[i : i + 1], o[i - n]]) for x, o in zip((q, k, v, g, beta), other)]
        outs.append(impl.gated_delta_step(*rows, states, torch.tensor([1, 2]))[0])
    assert torch.equal(states[0], torch.zeros(HV, DK, DV))
    torch.testing.assert_close(torch.cat([first, torch.stack(outs)]), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(states[1], one, atol=2e-5, rtol=1e-4)


def test_decode_step_matches_transformers_and_rows_are_independent(impl):
    b = 5
    q, k, v, g, beta = _inputs(0, rows=(b,))
    start = torch.randn(8, HV, DK, DV) * 0.1
    slots = torch.tensor([6, 0, 3, 1, 7])
    states = start.clone()
    out = impl.gated_delta_step(q, k, v, g, beta, states, slots)
    for i, s in enumerate(slots.tolist()):
        ref_out, ref_state = _transformers(torch_recurrent_gated_delta_rule, q[i : i + 1], k[i : i + 1],
                                           v[i : i + 1], g[i : i + 1], beta[i : i + 1], start[s])
        torch.testing.assert_close(out[i], ref_out[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(states[s], ref_state, atol=2e-5, rtol=1e-4)
        alone = start.clone()
        row = impl.gated_delta_step(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], alone,
                                   slots[i : i + 1])
        assert torch.equal(row[0], out[i]) and torch.equal(alone[s], states[s])
    for untouched in (2, 4, 5):
        assert torch.equal(states[untouched], start[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv_matches_transformers_and_continues_in_slices_and_steps(impl, dtype):
    c, kk, t = 40, 4, 50
    x = torch.randn(t, c).to(dtype)
    weight = (torch.randn(c, kk) * 0.5).to(dtype)
    ref = causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    state = torch.zeros(c, kk - 1, dtype=dtype)
    y = impl.causal_conv(x, weight, state)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref, **tol)
    assert torch.equal(state, x[-(kk - 1) :].t())
    sliced = torch.zeros(c, kk - 1, dtype=dtype)
    parts = [impl.causal_conv(x[a:b], weight, sliced) for a, b in ((0, 2), (2, 31), (31, t))]  # 2 < K-1 inputs
    assert torch.equal(torch.cat(parts), y) and torch.equal(sliced, state)
    pool = torch.zeros(3, c, kk - 1, dtype=dtype)
    impl.causal_conv(x[:45], weight, pool[2])  # the prefill leaves its state in slot 2
    steps = torch.stack([impl.causal_conv_step(x[i : i + 1], weight, pool, torch.tensor([2]))[0]
                         for i in range(45, t)])
    torch.testing.assert_close(steps, y[45:], **tol)
    conv_state = torch.zeros(1, c, kk - 1, dtype=dtype)
    conv_state[0] = x[44 - (kk - 2) : 45].t()
    upd = causal_conv1d_update(x[45:46].t()[None], conv_state, weight, None, "silu")[0, :, 0]
    torch.testing.assert_close(steps[0], upd, **tol)


@pytest.fixture(scope="module", params=[pytest.param(t.name, marks=() if t.name == RUNS else pytest.mark.slow)
                                        for t in TIERS])
def tier_lib(request):
    return build.load(next(t for t in TIERS if t.name == request.param), paths.cache_root() / "native")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_matches_reference_on_the_convolutions_strided_output(tier_lib, dtype):
    """Real head sizes (128), q, k and v as views of the convolution's output [T, C] (as the
    layer splits it), a prompt resumed mid-chunk: native ~ torch, prefill and decode step."""
    hk, hv, d, t = 2, 4, 128, CHUNK + 40
    c = 2 * hk * d + hv * d
    x, weight = torch.randn(t + 2, c).to(dtype), (torch.randn(c, 4) * 0.5).to(dtype)
    conv_state = torch.randn(c, 3).to(dtype)
    y, y_ref = (fn(x[:t], weight, s) for fn, s in ((_native(tier_lib, "causal_conv"), conv_state.clone()),
                                                   (dr.reference_causal_conv, conv_state.clone())))
    torch.testing.assert_close(y, y_ref, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    q, k, v = (part.unflatten(-1, (-1, d)) for part in y_ref.split([hk * d, hk * d, hv * d], -1))
    g, beta = -torch.rand(t, hv), torch.rand(t, hv)
    start = torch.randn(hv, d, d) * 0.1
    got, want = start.clone(), start.clone()
    out = _native(tier_lib, "gated_delta_rule")(q, k, v, g, beta, got, CHUNK - 7)
    ref = dr.reference_gated_delta_rule(q, k, v, g, beta, want, CHUNK - 7)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    pool = torch.stack([want, start])
    step = _native(tier_lib, "gated_delta_step")(q[:2], k[:2], v[:2], g[:2], beta[:2], pool.clone()[[1, 0]],
                                                 torch.tensor([1, 0]))
    step_ref = dr.reference_gated_delta_step(q[:2], k[:2], v[:2], g[:2], beta[:2], pool.clone()[[1, 0]],
                                             torch.tensor([1, 0]))
    torch.testing.assert_close(step.float(), step_ref.float(), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-2)


def test_ops_take_the_planned_kernel_and_fall_back_to_torch():
    """Where the plan names the native kernels, ops.* gives their bits; head sizes they do not
    take (not a multiple of 16) run the torch reference; slots outside the pool are refused."""
    plan = default_plan(torch.bfloat16)
    entries = {kind: k.name for kind, k in plan.entries().items()}
    native = library().lib is not None
    assert entries["delta rule, prefill"] == ("qvl_gated_delta_rule" if native else "torch")
    assert entries["short conv, decode"] == ("qvl_causal_conv_step" if native else "torch")
    q, k, v, g, beta = _inputs(20, torch.bfloat16)
    out = ops.gated_delta_rule(q, k, v, g, beta, torch.zeros(HV, DK, DV), 3)
    if native:
        assert torch.equal(out, dr.native_gated_delta_rule(library().lib, q, k, v, g, beta, torch.zeros(HV, DK, DV), 3))
        q24, k24 = q[..., :24], k[..., :24]
        assert dr.native_gated_delta_rule(library().lib, q24, k24, v, g, beta, torch.zeros(HV, 24, DV), 0) is None
        with pytest.raises(IndexError, match="slots"):
            ops.gated_delta_step(q[:1], k[:1], v[:1], g[:1], beta[:1], torch.zeros(2, HV, DK, DV), torch.tensor([2]))
    q24, k24 = q[..., :24], k[..., :24]
    want = dr.reference_gated_delta_rule(q24, k24, v, g, beta, torch.zeros(HV, 24, DV), 0)
    assert torch.equal(ops.gated_delta_rule(q24, k24, v, g, beta, torch.zeros(HV, 24, DV), 0), want)


@pytest.mark.slow  # cross-compiles and runs two builds under qemu
def test_aarch64_kernels_under_qemu(tmp_path):
    """The NEON and portable builds of the kernels, cross-compiled for aarch64 and run under
    qemu-user by tests/delta_rule_check.c: prefill and decode step against the rule token by
    token, slices at chunk multiples bit for bit, the convolution and its step."""
    cc, qemu = "aarch64-linux-gnu-gcc", "qemu-aarch64"
    if subprocess.run(["which", cc, qemu], capture_output=True).returncode != 0:
        pytest.skip("no aarch64 cross compiler / qemu-user (test.sh installs them as root)")
    check = Path(__file__).with_name("delta_rule_check.c")
    for name, flags in (("neon", ["-march=armv8-a"]), ("portable", ["-march=armv8-a", "-DQVL_PORTABLE"])):
        exe = tmp_path / f"check-{name}"
        built = subprocess.run([cc, "-O2", *flags, "-fopenmp", "-I", str(build.SOURCE_DIR), str(check),
                                *map(str, sorted(build.SOURCE_DIR.glob("*.c"))), "-o", str(exe), "-lm", "-static"],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
        ran = subprocess.run([qemu, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0 and "delta rule checked" in ran.stdout, f"{name}:\n{ran.stdout}\n{ran.stderr}"
