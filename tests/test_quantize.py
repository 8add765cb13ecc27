"""Weight-only int8/int4: kernels against a dequantised reference, loading, the
pre-quantised file format."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from qvl.config import ModelConfig
from qvl import paths
from qvl.kernels import build, linear, products
from qvl.kernels import library as library_module
from qvl.kernels.library import Library, library
from qvl.kernels.plan import GEMV_MAX_ROWS, default_plan
from qvl.kernels.products import prompt_products, unpack_nibbles
from qvl.quantize import (
    Bf16Linear,
    Int4Experts,
    Int4Linear,
    Int8Linear,
    QuantSpec,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    quantized_state,
)
from qvl.engine import Request
from qvl.sampling import SamplingParams
from qvl.weights import CheckpointError, load_model, quantized_cache_dir, save_quantized


def _module(kind: str, o: int, i: int, dtype, group=64, bias=False):
    w = torch.randn(o, i)
    if kind == "bf16":
        m = Bf16Linear(i, o, bias=bias, dtype=dtype)
        with torch.no_grad():
            m.weight.copy_(w)
    else:
        m = Int8Linear(i, o, bias, dtype) if kind == "int8" else Int4Linear(i, o, group, dtype)
        for key, value in quantized_state(m, "m", w, dtype).items():
            setattr(m, key.split(".", 1)[1], value)
        if bias:
            m.bias = torch.randn(o).to(dtype)
    m.use_plan(default_plan(dtype), "text")  # a decoder layer's kernels, as loading gives them
    return m, w


def planned_product(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ the int8 weight q (scales s) as a decoder layer's default plan runs it."""
    plan = default_plan(s.dtype).linear("text", "int8", *q.shape)
    return products.int8_product(x, q, s, bias, products.kernel_for(plan, x))


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Each product runs once through qvl's native kernels and once through torch's."""
    if request.param == "torch":
        monkeypatch.setattr(library_module, "_chosen", [Library(build.select_tier(), None, "test")])
    elif library().lib is None:
        pytest.skip("no C compiler: the native kernels are not built here")
    return request.param


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6, 40])  # GEMV (1-16 rows, tiles of 4) and dequantise + GEMM (more)
def test_linear_layers_match_dequantised_reference(kernels, kind, dtype, rows):
    m, w = _module(kind, 192, 384, dtype, bias=kind == "int8")
    x = torch.randn(2, rows, 384, dtype=dtype)
    weight = m.weight.float() if kind == "bf16" else m.dequantized().float()
    bias = getattr(m, "bias", None)
    reference = F.linear(x.float(), weight, None if bias is None else bias.float())
    # native int4 quantises activations to int8 per 128 columns (~1% error), the rest accumulate floats
    tol = 3e-2 if kind == "int4" and kernels == "native" and rows <= 16 else 2e-2 if dtype == torch.bfloat16 else 1e-4
    out = m(x)
    assert out.dtype == dtype and out.shape == (2, rows, 192)
    torch.testing.assert_close(out.float(), reference, atol=tol * reference.abs().max().item(), rtol=tol)
    if kind != "bf16":  # and the quantisation itself stays close to the float weight
        err = (m.dequantized().float() - w).abs().max() / w.abs().max()
        assert err < (0.01 if kind == "int8" else 0.15)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_float32_products_dequantise_in_blocks_of_rows(kernels, kind, monkeypatch):
    """float32 compute dequantises DEQUANTIZED_ROWS weight rows per GEMM (a last block shorter):
    the same product as the whole matrix at once, bias included, up to the float32 GEMM's
    rounding, which follows its shape (on Zen 5 MKL moved one of 18,000 outputs by 1.2e-5). 200 output
    rows: not a multiple of 16, so x86's 16-bit pair kernel does not take the int8 product."""
    m, _ = _module(kind, 200, 256, torch.float32, bias=kind == "int8")
    x = torch.randn(3, 30, 256)
    whole = m(x)
    monkeypatch.setattr(products, "DEQUANTIZED_ROWS", 64)
    torch.testing.assert_close(m(x), whole, atol=1e-6 * whole.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_group_sizes_and_row_gather(kernels, group):
    m, _ = _module("int4", 96, 512, torch.float32, group=group)
    full = m.dequantized()
    q, scale, zero = quantize_int4(full, group)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    reference = ((unpack_nibbles(m.weight).float().view(96, -1, group) - 8)
                 * m.scales[..., None] + m.zeros[..., None]).view(96, 512)
    torch.testing.assert_close(full, reference)
    rows = torch.tensor([0, 5, 63, 64, 95, 5])
    torch.testing.assert_close(m.dequantized(rows), full[rows])
    x = torch.randn(1, 512)
    ref = F.linear(x, full)
    torch.testing.assert_close(m(x), ref, atol=3e-2 * ref.abs().max().item(), rtol=0)


def test_kernel_build_failure_is_reported_and_torch_kernels_take_over(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises((RuntimeError, OSError)):
        build.build(tmp_path, build.select_tier())
    monkeypatch.setenv("QVL_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(paths, "cache_root", lambda: tmp_path / "empty-cache")
    monkeypatch.setattr(library_module, "_chosen", [])
    chosen = library()
    assert chosen.lib is None and "native kernels unavailable" in capsys.readouterr().err
    assert default_plan(torch.float32).linear("text", "int4", 64, 128, 64).decode.name == "dequantize"
    assert "off" in chosen.describe()
    m, _ = _module("int4", 64, 128, torch.float32)
    x = torch.randn(1, 128)
    torch.testing.assert_close(m(x), F.linear(x, m.dequantized()))


def test_int8_is_symmetric_per_channel():
    w = torch.randn(8, 16)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (8,)
    assert (q.abs().amax(1) == 127).all()


def _logits(model, ids):
    from qvl.generate import new_cache

    cache = new_cache(model, 1, ids.shape[1])
    cos, sin = model.rope(torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1))
    with torch.inference_mode():
        return model.logits(model.language_model(model.embed(ids), cos, sin, cache, 0))


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32), QuantSpec("int8", vision=True)])
def test_quantised_models_stay_close_to_fp32(tiny_checkpoint, spec):
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    ids = torch.tensor([[9707, 11, 1879, 0, 108386, 151644, 872, 198, 3838, 374]])
    ref = _logits(load_model(tiny_checkpoint, cfg, torch.float32), ids)
    model = load_model(tiny_checkpoint, cfg, torch.float32, spec)
    assert isinstance(model.lm_head, Int4Linear if spec.weights == "int4" else Int8Linear)
    assert not any(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 and p.dim() == 2
                   for n, p in model.language_model.named_parameters())  # every text matrix quantised
    out = _logits(model, ids)
    cosine = F.cosine_similarity(out.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    assert cosine.min() > (0.999 if spec.weights == "int8" else 0.93), cosine


def test_prequantised_checkpoint_loads_identically_without_requantising(tiny_checkpoint, tmp_path):
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    spec = QuantSpec("int4", 64)
    out = save_quantized(tiny_checkpoint, tmp_path / "q", spec)
    a = load_model(tiny_checkpoint, cfg, torch.bfloat16, spec).state_dict()
    b = load_model(out, cfg, torch.bfloat16).state_dict()  # format read from the file's metadata
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(CheckpointError, match="pre-quantised int4"):
        load_model(out, cfg, torch.bfloat16, QuantSpec("int8"))
    (tmp_path / "renamed-int8").symlink_to(out)  # the format never comes from a name
    model = load_model(tmp_path / "renamed-int8", cfg, torch.bfloat16)
    assert isinstance(model.lm_head, Int4Linear)


def test_weights_quantised_at_load_are_kept_for_the_next_start(tiny_checkpoint):
    from qvl.engine import Engine, EngineOptions
    from qvl.weights import quantized_cache_dir

    options = EngineOptions(model=str(tiny_checkpoint), weights="int4", group_size=64, threads=1)
    first = Engine.load(options)
    vision = isinstance(first.model.visual.blocks[0].attn.qkv, Int8Linear)  # the tier decides (int8 x int8 on x86)
    spec = QuantSpec("int4", 64, vision)
    kept = quantized_cache_dir(tiny_checkpoint, spec, first.model.dtype)
    assert (kept / "model.safetensors").exists() and (kept / "tokenizer.json").exists()
    second = Engine.load(options)
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")  # the first start streamed what quantising at load gives
    a, b = load_model(kept, cfg, first.model.dtype).state_dict(), load_model(tiny_checkpoint, cfg, first.model.dtype,
                                                                             spec).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert quantized_cache_dir(tiny_checkpoint, QuantSpec("int4", 128, vision), first.model.dtype) != kept  # other format
    assert quantized_cache_dir(tiny_checkpoint, QuantSpec("int4", 64, vision), torch.float16) != kept  # other scales dtype


def test_quantised_files_are_64_byte_aligned_and_readable_by_safetensors(tmp_path):
    import json
    import struct

    from safetensors.torch import load_file

    from qvl.weights import save_aligned

    state = {"odd": torch.arange(5, dtype=torch.int8), "a": torch.ones(64, 3, dtype=torch.int8),
             "b": torch.randn(32, dtype=torch.bfloat16)}
    path = tmp_path / "x.safetensors"
    save_aligned(state, path, {"qvl_weights": "int8"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert (8 + n) % 64 == 0
    assert all(header[k]["data_offsets"][0] % 64 == 0 for k in ("a", "b"))
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_released_pages_of_a_mapped_tensor_read_back_the_same(tmp_path):
    """The vision tower's plain int8 weights, once packed, give their file pages back
    (qvl.mapped.release); a released file-backed tensor still reads the file's values, and
    anonymous memory is never touched."""
    import sys

    from safetensors import safe_open
    from safetensors.torch import save_file

    from qvl import mapped

    data = torch.randint(-127, 128, (512, 4096), dtype=torch.int8)
    save_file({"w": data, "small": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        w = f.get_tensor("w")
    assert torch.equal(w, data)
    anonymous = data.clone()
    assert not mapped.release(anonymous) and torch.equal(anonymous, data)
    if sys.platform.startswith("linux"):
        assert mapped.release(w)
    assert torch.equal(w, data)


def test_quantised_weights_unused_for_a_month_are_removed(tiny_checkpoint, capsys):
    """Each start marks its quantised-weights entry used and removes the entries beside it that
    no start used for 30 days (a replaced checkpoint, a format no longer asked for), never one
    used recently."""
    import os
    import time

    from qvl.engine import Engine, EngineOptions
    from qvl.weights import quantized_cache_dir

    options = EngineOptions(model=str(tiny_checkpoint), weights="int8", threads=1)
    first = Engine.load(options)
    vision = isinstance(first.model.visual.blocks[0].attn.qkv, Int8Linear)
    current = quantized_cache_dir(tiny_checkpoint, QuantSpec("int8", vision=vision), first.model.dtype)
    old, recent, unmarked = (current.parent / name for name in ("tiny-int8-old", "tiny-int4-recent", "tiny-bf16-x"))
    month_ago = time.time() - 31 * 86400
    for entry in (old, recent, unmarked):
        entry.mkdir()
        (entry / "model.safetensors").write_bytes(b"x")
        (entry / ".used").touch()
    os.utime(old / ".used", (month_ago, month_ago))
    (unmarked / ".used").unlink()
    os.utime(unmarked, (month_ago, month_ago))  # written before entries were marked: its own time counts
    os.utime(current / ".used", (month_ago, month_ago))  # about to be used again
    capsys.readouterr()
    Engine.load(options)
    assert not old.exists() and not unmarked.exists() and recent.exists()
    assert (current / "model.safetensors").exists() and (current / ".used").stat().st_mtime > month_ago
    assert "removed 2 quantised-weights cache entries" in capsys.readouterr().err


def test_many_row_products_reuse_one_scratch_buffer_per_thread(monkeypatch):
    """Prefill's products dequantise into a reused buffer where qvl's own kernels do not take
    them (int4 without AMX, CPUs other than x86): consecutive products with different weights
    (and shapes) each equal the product with a freshly dequantised weight, and another thread
    gets a buffer of its own."""
    import threading

    for kernel in ("amx_bf16_linear", "amx_i16_linear", "i16_linear"):  # the path of those CPUs
        monkeypatch.setattr(linear, kernel, lambda *args: None)

    from qvl.kernels.products import dequantize_int8, scratch

    torch.manual_seed(0)
    x = torch.randn(GEMV_MAX_ROWS * 4 + 8, 256).bfloat16()  # past the GEMV kernel's rows (64 on AMX tiles)
    weights = [quantize_int8(torch.randn(n, 256)) for n in (384, 128, 384)]
    fresh = [F.linear(x, dequantize_int8(q, s.bfloat16())) for q, s in weights]
    got = [planned_product(x, q, s.bfloat16()) for q, s in weights]
    for a, b in zip(got, fresh):
        assert torch.equal(a, b)
    last_q, last_s = weights[-1]  # the buffer holds the last product's weight
    assert torch.equal(scratch(tuple(last_q.shape), torch.bfloat16), dequantize_int8(last_q, last_s.bfloat16()))
    mine = scratch((8, 8), torch.bfloat16).data_ptr()
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(scratch((8, 8), torch.bfloat16).data_ptr()))
    t.start()
    t.join()
    assert theirs[0] != mine and scratch((8, 8), torch.bfloat16).data_ptr() == mine


def test_int8_products_take_the_gemv_kernel_up_to_the_tiers_row_limit():
    """A decoder layer's int8 plan: up to its decode_rows (64 on AMX tiles, 16 elsewhere) a
    product is the GEMV kernel's exact 16-bit scheme; one row more, the int8 tile kernel (16-bit
    codes per row) on AMX, the 16-bit pair kernel elsewhere on x86 (and for float32 on AMX), else
    the dequantised weight through the float GEMM; a prompt's rows take that kernel from one row on."""
    from qvl.kernels.products import dequantize_int8

    k = library()
    if k.lib is None:
        pytest.skip("no native kernels")
    plan = default_plan(torch.bfloat16).linear("text", "int8", 96, 256)
    assert plan.decode_rows == (64 if k.has(build.AMX_INT8) else GEMV_MAX_ROWS) and plan.prompt_rows == 0
    torch.manual_seed(1)
    q, s = quantize_int8(torch.randn(96, 256))
    s = s.bfloat16()

    def many(x):
        return (linear.amx_i16_linear(k.lib, x, q, s) if k.has(build.AMX_INT8) else linear.i16_linear(k.lib, x, q, s)
                if default_plan(torch.bfloat16).pair_products else F.linear(x, dequantize_int8(q, s)))

    for rows in (plan.decode_rows, plan.decode_rows + 1):
        x = torch.randn(rows, 256).bfloat16()
        kernel = linear.gemv(k.lib, build.W_INT8, x, q, 96, s)
        assert torch.equal(planned_product(x, q, s), kernel if rows == plan.decode_rows else many(x)), rows
    with prompt_products():
        assert torch.equal(planned_product(x[:1], q, s), many(x[:1]))
    if default_plan(torch.float32).pair_products:
        x = torch.randn(plan.decode_rows + 1, 256)
        assert torch.equal(planned_product(x, q, s.float()), linear.i16_linear(k.lib, x, q, s.float()))


@pytest.mark.parametrize("rows,k_in,n", [(65, 256, 96), (300, 128, 48), (17, 64, 16)])
def test_prefill_int8_products_on_int8_tiles_with_16_bit_activation_codes(rows, k_in, n):
    """Prefill's int8 products on AMX: each activation row in 16-bit codes (its own scale),
    exact int32 sums on int8 tiles. Within bf16's rounding of the exact product even with an
    outlier 300x the rest in a row, zero rows give the bias, a row's result is bit for bit the
    same alone as among others (batch invariance), and it is what int8_product runs."""
    k = library()
    if k.lib is None or not k.has(build.AMX_INT8):
        pytest.skip("no AMX tiles on this CPU")
    torch.manual_seed(3)
    q, s = quantize_int8(torch.randn(n, k_in))
    s, bias = s.to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k_in).to(torch.bfloat16)
    x[1, 5] = 300.0  # a massive activation
    x[2] = 0
    y = linear.amx_i16_linear(k.lib, x, q, s, bias)
    exact = x.double() @ (q.double() * s.double()[:, None]).T + bias.double()
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, n)
    close = lambda a, b: torch.testing.assert_close(a.double(), b, rtol=2**-7, atol=2e-3 * b.abs().max().item())
    close(y[2:], exact[2:])
    close(y[1], exact[1])  # the outlier's row: the rest of it in codes 1/32767 of 300 apart
    assert torch.equal(y[2], bias)
    for r in (0, rows - 1):
        assert torch.equal(linear.amx_i16_linear(k.lib, x[r : r + 1], q, s, bias), y[r : r + 1])
    if rows > default_plan(torch.bfloat16).linear("text", "int8", n, k_in).decode_rows:
        assert torch.equal(planned_product(x, q, s, bias), y)
    assert linear.amx_i16_linear(k.lib, x[:, :k_in - 32].contiguous(), q[:, :k_in - 32].contiguous(), s) is None  # K % 64
    assert linear.amx_i16_linear(k.lib, x, q[:8].contiguous(), s[:8]) is None  # N % 16
    assert linear.amx_i16_linear(k.lib, x, q, s.float()) is None  # scales of another dtype than x


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _edited_copy(src, dst, edit):
    """A copy of checkpoint folder `src` at `dst` whose tensors `edit(state)` changed in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"), dirs_exist_ok=True)
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.slow  # writes three checkpoints
@pytest.mark.parametrize("preset,changes,spec", [
    ("tiny", None, QuantSpec("int8", vision=True)),  # tied head stored once, as the int8 head; smoothed int8 vision
    ("tiny-moe", {"text_config": {"moe_intermediate_size": 64}}, QuantSpec("int4", 32)),  # int4 experts
])
def test_quantising_tensor_by_tensor_writes_what_the_loaded_model_holds(preset, changes, spec, tmp_path):
    """`qvl quantize`, the first start's cache and `qvl synth --weights` quantise a tensor at a
    time (a 30B model on a 24 GB machine); the files are those of the whole model quantised in
    memory and written, for bf16 and float32 scales alike."""
    from qvl.synth import write_checkpoint
    from qvl.weights import checkpoint_files, iter_tensors, read_metadata, write_quantized, write_streamed

    def tensors(folder):
        return dict(iter_tensors(checkpoint_files(folder)))

    bf16 = write_checkpoint(tmp_path / "bf16", preset, seed=3, changes=changes)
    cfg = ModelConfig.from_file(bf16 / "config.json")
    for dtype in (torch.bfloat16, torch.float32):
        whole = tensors(write_quantized(load_model(bf16, cfg, dtype, spec), spec, bf16, tmp_path / f"whole-{dtype}"))
        _assert_same_tensors(whole, tensors(write_streamed(bf16, tmp_path / f"streamed-{dtype}", spec, dtype)))
    direct = write_checkpoint(tmp_path / "direct", preset, seed=3, changes=changes, quant=spec, shard_bytes=1 << 20)
    files = checkpoint_files(direct)
    assert len(files) > 1 and (direct / "model.safetensors.index.json").exists()  # sharded as published
    assert QuantSpec.from_metadata(read_metadata(files)) == spec
    _assert_same_tensors(tensors(save_quantized(bf16, tmp_path / "quantized", spec)), tensors(direct))
    model = load_model(direct, cfg, torch.bfloat16)
    assert isinstance(model.lm_head, Int8Linear if spec.weights == "int8" else Int4Linear)
    assert isinstance(model.visual.blocks[0].attn.qkv, Int8Linear) == spec.vision
    assert any(isinstance(m, Int4Experts) for m in model.modules()) == (preset == "tiny-moe")


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [65, 97, 300])
def test_many_row_products_on_amx_tiles_round_only_their_outputs(kind, rows, monkeypatch):
    """Prefill's int8/int4 products on AMX convert the weights to bf16 (int8 codes exactly, then
    the row scale after the sum; int4 groups dequantised as for the GEMM) and sum in float32 over
    all of K: within the output's bf16 rounding of the exact product (int4: and of its bf16
    weights), and a row's result is the same alone as among others."""
    k = library()
    if k.lib is None or not k.has(build.AMX_INT8):
        pytest.skip("no AMX tiles on this CPU")
    w = torch.randn(96, 256)
    if kind == "int8":
        q, s = quantize_int8(w)
        s, z, code = s.to(torch.bfloat16), None, build.W_INT8
        weight = q.double() * s.double()[:, None]
    else:
        codes, s, z = quantize_int4(w, 64)
        q, s, z, code = pack_nibbles(codes), s.to(torch.bfloat16), z.to(torch.bfloat16), build.W_INT4
        weight = products.dequantize_int4(q, s, z, 64).double()  # the bf16 weights the GEMM would use
    bias = torch.randn(96).to(torch.bfloat16)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    kernel = linear.amx_bf16_linear
    y = kernel(k.lib, code, x, q, s, z, 64, bias=bias)
    exact = x.double() @ weight.T + bias.double()
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-4 * exact.abs().max().item())
    assert torch.equal(linear.amx_bf16_linear(k.lib, code, x[-1:], q, s, z, 64, bias=bias), y[-1:])
    if kind == "int4":  # what prefill runs for int4 (counted: the dequantising path can give the same values)
        calls = []
        monkeypatch.setattr(linear, "amx_bf16_linear", lambda *args: calls.append(1) or kernel(*args))
        plan = default_plan(torch.bfloat16).linear("text", "int4", 96, 256, 64)
        assert torch.equal(products.int4_product(x, q, s, z, 64, products.kernel_for(plan, x)),
                           kernel(k.lib, code, x, q, s, z, 64))
        assert len(calls) == 1
        monkeypatch.undo()
    if kind == "int4":  # without zeros or a group size: refused, not a crash
        assert kernel(k.lib, code, x, q, s, None, 64) is None and kernel(k.lib, code, x, q, s, z, 0) is None
    short = x[:, :240].contiguous()
    assert linear.amx_bf16_linear(k.lib, code, short, q[:, :240 // (1 if kind == "int8" else 2)].contiguous(),
                                  s, z, 64) is None  # K % 32
    many = torch.zeros(8193, 256, dtype=torch.bfloat16)
    assert linear.amx_bf16_linear(k.lib, code, many, q, s, z, 64) is None  # more than 2^21 activation values


def test_a_broken_checkpoint_names_its_tensors_and_leaves_no_cache_entry(tiny_checkpoint, tmp_path):
    """The first start quantises into the cache: a checkpoint missing a tensor fails with the
    loader's message, and nothing is kept that a later start would load."""
    from qvl.engine import Engine, EngineOptions
    from qvl.weights import quantized_cache_dir

    broken = _edited_copy(tiny_checkpoint, tmp_path / "broken",
                          lambda state: state.pop("model.language_model.layers.1.mlp.down_proj.weight"))
    options = EngineOptions(model=str(broken), weights="int8", threads=1)
    with pytest.raises(CheckpointError, match="language_model.layers.1.mlp.down_proj.weight"):
        Engine.load(options)
    caches = quantized_cache_dir(broken, QuantSpec("int8"), torch.bfloat16).parent
    assert not list(caches.glob("broken-*/model*")) and not list(caches.glob("broken-*/.shard-*"))


def test_a_damaged_cache_entry_is_quantised_again(tiny_checkpoint, capsys):
    """Kept quantised weights that no longer read (a crash, a disk error) cost one more
    quantisation, not a start that fails until someone deletes the cache."""
    from qvl.engine import Engine, EngineOptions
    from qvl.weights import quantized_cache_dir

    options = EngineOptions(model=str(tiny_checkpoint), weights="int8", threads=1)
    first = Engine.load(options)
    vision = isinstance(first.model.visual.blocks[0].attn.qkv, Int8Linear)
    kept = quantized_cache_dir(tiny_checkpoint, QuantSpec("int8", vision=vision), first.model.dtype)
    (kept / "model.safetensors").unlink()  # a new file, as a crash leaves it (the first engine keeps its mapping)
    (kept / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    second = Engine.load(options)
    assert "unreadable" in capsys.readouterr().err
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_streamed_quantisation_checks_the_checkpoint_and_keeps_the_source(tiny_checkpoint, tmp_path):
    """`qvl quantize` names missing, unexpected and misshapen tensors before writing anything,
    and refuses to write into the checkpoint's own folder."""
    from qvl.weights import write_streamed

    def missing_and_unexpected(state):
        del state["model.language_model.layers.0.mlp.down_proj.weight"]
        state["model.language_model.layers.0.mlp.weight_scale_inv"] = torch.ones(2)

    def misshapen(state):
        name = "model.language_model.layers.0.mlp.up_proj.weight"
        state[name] = state[name][:8]

    bad = _edited_copy(tiny_checkpoint, tmp_path / "bad", missing_and_unexpected)
    with pytest.raises(CheckpointError, match="1 missing tensors: language_model.layers.0.mlp.down_proj.weight.*"
                                              "1 unexpected tensors: model.language_model.layers.0.mlp.weight_scale_inv"):
        save_quantized(bad, tmp_path / "out", QuantSpec("int8"))
    assert not list((tmp_path / "out").glob("*"))  # nothing half-written
    _edited_copy(tiny_checkpoint, bad, misshapen)
    with pytest.raises(CheckpointError, match="shapes do not match"):
        save_quantized(bad, tmp_path / "out", QuantSpec("int8"))
    with pytest.raises(CheckpointError, match="own folder"):
        write_streamed(bad, bad, QuantSpec("int8"), torch.bfloat16)
    assert (bad / "model.safetensors").exists()


def test_kept_weights_key_follows_the_content_not_the_mtime(tiny_checkpoint, tmp_path):
    """Copying another checkpoint of the same size over a model and putting the old mtime
    back must not bring back the weights quantised from the old file."""
    from qvl.synth import write_checkpoint

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    weights = model / "model.safetensors"
    other = write_checkpoint(tmp_path / "other", "tiny", seed=5) / "model.safetensors"
    assert other.stat().st_size == weights.stat().st_size and other.read_bytes() != weights.read_bytes()
    spec = QuantSpec("int8")
    started = time.perf_counter()
    before = quantized_cache_dir(model, spec, torch.bfloat16)
    assert time.perf_counter() - started < 0.5  # a few small reads, not a hash of the file
    assert quantized_cache_dir(model, spec, torch.bfloat16) == before  # stable
    stat = weights.stat()
    shutil.copyfile(other, weights)  # written in place: same path, same size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert quantized_cache_dir(model, spec, torch.bfloat16) != before


def test_prequantised_int8_checkpoint_decodes(tiny_checkpoint, tmp_path):
    """Weights read from a file's memory map are copied to aligned memory before the
    int8 kernel sees them (it crashed on the mmap's 8-byte alignment)."""
    from qvl.engine import Engine, EngineOptions
    from qvl.quantize import QuantSpec
    from qvl.weights import save_quantized

    out = save_quantized(tiny_checkpoint, tmp_path / "int8", QuantSpec("int8"))
    loaded = Engine.load(EngineOptions(model=str(out), threads=1, answer_cache_entries=0))
    fresh = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", threads=1, quant_cache=False))
    assert all(b.data_ptr() % 64 == 0 for n, b in loaded.model.named_buffers() if b.dtype == torch.int8)
    request = Request([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_new_tokens=8))
    assert loaded.generate(request).token_ids == fresh.generate(request).token_ids


def test_prequantised_int8_checkpoint_runs_as_float_and_int4(tiny_checkpoint, tmp_path):
    """An int8 file asked for another format loads its int8 values as float weights (the demo
    model ships as int8 only): float32 holds exactly scale x code, and int4 quantises those."""
    from qvl.engine import Engine, EngineOptions

    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    out = save_quantized(tiny_checkpoint, tmp_path / "int8", QuantSpec("int8"))
    int8 = load_model(out, cfg, torch.float32)
    as_float = load_model(out, cfg, torch.float32, dequantise=True)
    layer = "language_model.layers.0.mlp.down_proj"
    codes = int8.get_submodule(layer)
    expected = codes.weight.float() * codes.scales.float()[:, None]
    assert torch.equal(as_float.get_submodule(layer).weight, expected)
    assert torch.equal(as_float.language_model.embed_tokens.weight,
                       int8.lm_head.weight.float() * int8.lm_head.scales.float()[:, None])
    engine = Engine.load(EngineOptions(model=str(out), weights="int4", threads=1, quant_cache=False))
    assert engine.weights.startswith("int4")
    with pytest.raises(ValueError, match="pre-quantised int4"):
        Engine.load(EngineOptions(model=str(save_quantized(tiny_checkpoint, tmp_path / "int4", QuantSpec("int4"))),
                                  weights="bf16", threads=1))
