"""The int8 vision tower: chosen per tier by default, smoothed before quantising (data-free, from
its norms), kept in the quantised-weights cache exactly as computed, and close to float."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from qvl import paths
from qvl.kernels import attention, build, linear
from qvl.kernels import library as library_module
from qvl.kernels.library import Library, library
from qvl.kernels.plan import PACKED, Plan
from qvl.quantize import Int8Linear, QuantSpec

TIERS = {t.name: t for t in build.tiers()} if build.compiler() else {}


@pytest.fixture(scope="module")
def tier_kernels():
    """name -> the library built for that tier (only tiers this CPU can run)."""
    built: dict[str, Library] = {}

    def get(name: str) -> Library:
        if name not in TIERS:
            pytest.skip(f"this CPU cannot run the {name} tier")
        if name not in built:
            built[name] = Library(TIERS[name], build.load(TIERS[name], paths.cache_root() / "native"))
        return built[name]

    return get


def load_on(monkeypatch, lib: Library, checkpoint, **options):
    from qvl.engine import Engine, EngineOptions

    monkeypatch.setenv("QVL_ISA", lib.tier.name)  # the compute dtype follows the tier too
    monkeypatch.setattr(library_module, "_chosen", [lib])
    return Engine.load(EngineOptions(model=str(checkpoint), threads=1, **options))


def vision_layers(engine) -> list[Int8Linear]:
    return [m for n, m in engine.model.named_modules() if n.startswith("visual.") and isinstance(m, Int8Linear)]


def int8x8(m: Int8Linear) -> bool:
    """The layer's many-row products run int8 x int8 (the byte kernel, or a packed weight)."""
    return m.plan.prefill.name in ("q8_linear", *PACKED)


def byte_codes(m: Int8Linear) -> bool:
    return m.plan.prefill.name == "q8_linear"


def text_layers(engine) -> list[Int8Linear]:
    return [m for n, m in engine.model.named_modules() if n.startswith("language_model.") and isinstance(m, Int8Linear)]


def features(engine, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    patches = torch.randn(64, engine.cfg.vision.patch_dim)
    with torch.inference_mode():
        embeds, _ = engine.model.encode_images(patches.to(engine.model.dtype), [(1, 8, 8)])
    return embeds.float()


@pytest.mark.slow  # builds other tiers' libraries
def test_defaults_per_tier(monkeypatch, tiny_checkpoint, tier_kernels):
    """x86 without bf16 products: float32 compute, the vision tower int8 and int8 x int8; with
    VNNI the vision tower's and prefill's int8 products in 8-bit codes per group (qvl's
    byte-product kernel, unpacked weights), elsewhere the vision tower's through oneDNN's int8
    GEMM (it beats the float32 one there); portable C: int8 vision weights (memory), float
    products; prefill's layers keep float or 16-bit codes elsewhere unless asked."""
    vnni = load_on(monkeypatch, tier_kernels("avx512-nobf16"), tiny_checkpoint, weights="int8")
    assert vnni.model.dtype == torch.float32 and vnni.int8_activations == "all"
    assert vision_layers(vnni) and all(int8x8(m) for m in vision_layers(vnni))
    unpacked = [m for m in vision_layers(vnni) + text_layers(vnni) if m is not vnni.model.lm_head]
    assert all(byte_codes(m) and m.packed is None and m.weight is not None for m in unpacked)
    assert not byte_codes(vnni.model.lm_head)  # prefill computes only the last row's logits
    assert "vision-int8" in vnni.model_id and "int8-activations-all" in vnni.model_id
    sixteen = load_on(monkeypatch, tier_kernels("avx512-nobf16"), tiny_checkpoint, weights="int8",
                      int8_activations="vision")  # the opt-out: prefill back to 16-bit codes
    assert sixteen.int8_activations == "vision" and not any(byte_codes(m) for m in text_layers(sixteen))
    assert all(byte_codes(m) for m in vision_layers(sixteen))  # the tower keeps its group codes

    # plain AVX2: the byte kernel in 7-bit codes (vpmaddubsw) for the tower; int4 weights' prefill
    # in 8-bit codes (nibbles cannot overflow the byte instruction), so auto is "all" for int4
    avx2 = load_on(monkeypatch, tier_kernels("avx2"), tiny_checkpoint, weights="int4")
    assert avx2.model.dtype == torch.float32 and avx2.int8_activations == "all"
    assert vision_layers(avx2) and all(byte_codes(m) and m.packed is None for m in vision_layers(avx2))
    assert all(m.plan.prefill.code_bits == 7 for m in vision_layers(avx2))
    assert all(m.plan.prefill.name == "q4_linear" and m.plan.prefill.code_bits == 8
               for m in text_layers(avx2) if m is not avx2.model.lm_head)
    assert "int8-activations-all-7bit" in avx2.model_id

    portable = load_on(monkeypatch, tier_kernels("portable"), tiny_checkpoint, weights="int8")
    assert portable.model.dtype == torch.float32 and portable.int8_activations == "off"
    assert vision_layers(portable) and not any(int8x8(m) for m in vision_layers(portable))

    every = load_on(monkeypatch, tier_kernels("avx2"), tiny_checkpoint, weights="int8", int8_activations="all")
    assert all(int8x8(m) for m in vision_layers(every) + text_layers(every))


SATURATING_ONEDNN = """
import sys
import torch
import torch.nn.functional as F
from qvl.engine import Engine, EngineOptions
from qvl.kernels import linear
from qvl.kernels.library import Library, library

# what the tests elsewhere cannot see on a CPU with VNNI: 8-bit codes saturate here, 7-bit ones do not
# (oneDNN takes the tower where qvl's build has no byte kernel: AVX-512 without VNNI; here plain
# AVX2's byte kernel is set aside to stand for that)
Library.q8_levels = property(lambda self: 0)
w = torch.full((32, 64), 127, dtype=torch.int8)
for levels, exact in ((255, False), (127, True)):
    codes = torch.full((32, 64), levels, dtype=torch.uint8)
    got = linear.int8_gemm(codes, linear.pack_int8(w), 32)
    assert torch.equal(got.double(), codes.double() @ w.double().t()) == exact, levels
assert library().int8_levels == 127, library().int8_levels

def features(engine):
    torch.manual_seed(0)
    patches = torch.randn(64, engine.cfg.vision.patch_dim)
    with torch.inference_mode():
        return engine.model.encode_images(patches, [(1, 8, 8)])[0].float().flatten()

options = dict(model=sys.argv[1], threads=1, weights="int8", dtype="fp32")
reference = features(Engine.load(EngineOptions(**options, vision_int8=False, int8_activations="off")))
engine = Engine.load(EngineOptions(**options, int8_activations="all"))
assert engine.model_id.endswith("|int8-activations-all-7bit"), engine.model_id
layers = [(n, m) for n, m in engine.model.named_modules() if hasattr(m, "packed") and n != "lm_head"]
assert layers and all(m.plan.prefill.name == "onednn_int8" and m.plan.prefill.code_bits == 7 for _, m in layers)
assert all((m.weight is None) == n.startswith("visual.") for n, m in layers)  # decoding keeps the text weights
cosine = F.cosine_similarity(features(engine), reference, 0).item()
assert cosine > 0.999, cosine
print("ok", cosine)
"""


@pytest.mark.parametrize("tier, kernel", [("avx512-nobf16", "q8_linear"), ("avx2-vnni", "q8_linear"),
                                          ("avx2", "i16_linear")])
@pytest.mark.slow  # builds other tiers' libraries
def test_float32_tiers_prefill_int8_products_in_integer_codes(monkeypatch, tiny_checkpoint, tier_kernels, tier,
                                                              kernel):
    """The default on x86 without bf16 products (int8 weights, float32 compute): prefill's int8
    products run qvl_q8_linear (8-bit activation codes per 64 columns) where the CPU has VNNI,
    qvl_i16_linear (16-bit codes per row) elsewhere (plain AVX2's byte kernel has 7-bit codes,
    too coarse for prefill: docs/decisions/int8-activations.md), and a two-image prompt's logits and
    greedy answer match the dequantised float32 path they replaced."""
    from tests.test_model_parity import two_image_request

    from qvl.generate import new_cache, prefill
    from qvl.stream import Timings

    engine = load_on(monkeypatch, tier_kernels(tier), tiny_checkpoint, weights="int8", max_image_tokens=256,
                     vision_cache_mb=0, prefix_cache_mb=0, answer_cache_entries=0)  # every answer computed
    assert engine.model.dtype == torch.float32 and engine.plan.pair_products
    assert engine.int8_activations == ("all" if kernel == "q8_linear" else "vision")
    assert all(m.plan.prefill.name == kernel for m in text_layers(engine) if m is not engine.model.lm_head)
    run, calls, logits, answers = getattr(linear, kernel), [], [], []
    for codes in (True, False):
        for name in ("q8_linear", "i16_linear"):  # off: dequantise + float32 GEMM
            monkeypatch.setattr(linear, name, (lambda *a, **kw: calls.append(1) or run(*a, **kw)) if codes and
                                name == kernel else (lambda *a, **kw: None))
        with torch.inference_mode():
            prompt = engine.prepare(engine.parse(two_image_request()), Timings())
            logits.append(prefill(engine.model, new_cache(engine.model, 1, len(prompt) + 1), prompt))
        answers.append(engine.generate(two_image_request(12)).token_ids)
    assert len(prompt) > engine.model.lm_head.plan.decode_rows and calls
    if kernel == "q8_linear":  # 8-bit codes: within the distance of the float path (1.6% here)
        assert F.cosine_similarity(logits[0].flatten(), logits[1].flatten(), 0) > 0.999
    else:  # 16-bit codes: as close as float32's own rounding differences
        assert (logits[0] - logits[1]).norm() / logits[1].norm() < 1e-3
    assert answers[0] == answers[1]


@pytest.mark.slow  # a fresh process loading an engine
def test_without_vnni_activations_run_in_seven_bits_exactly(tiny_checkpoint):
    """oneDNN's int8 GEMM without VNNI (plain AVX2, AVX-512 without VNNI: emulated with
    ONEDNN_MAX_CPU_ISA=AVX2 in a fresh process) saturates its 16-bit pair sums on 8-bit
    activation codes. The library probes it, the activations are quantised to 7-bit codes there,
    and the vision tower's features stay close to float."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "QVL_ISA": "avx2"}  # qvl's kernels without VNNI too
    ran = subprocess.run([sys.executable, "-c", SATURATING_ONEDNN, str(tiny_checkpoint)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.startswith("ok"), ran.stdout + ran.stderr


@pytest.mark.slow  # builds other tiers' libraries
def test_amx_tier_runs_the_vision_tower_int8_with_bf16_compute(monkeypatch, tiny_checkpoint, tier_kernels):
    """With AMX, oneDNN's int8 GEMM runs on AMX-INT8 tiles (1.7x its bf16 ones): the vision
    tower is int8 x int8 there too, in bf16 compute; without the native kernels it stays bf16."""
    avx2 = tier_kernels("avx2")
    amx = build.Tier("avx512", avx2.tier.needs, avx2.tier.flags, bf16=True, amx=True)
    monkeypatch.setattr(build, "select_tier", lambda: amx)
    from qvl.engine import Engine, EngineOptions

    monkeypatch.setattr(library_module, "_chosen", [Library(amx, avx2.lib)])
    monkeypatch.setattr(Library, "q8_levels", property(lambda self: 0))  # AMX's bf16 skips the byte kernel
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=1, weights="int8"))
    assert engine.model.dtype == torch.bfloat16 and engine.int8_activations == "vision"
    assert vision_layers(engine) and all(int8x8(m) for m in vision_layers(engine))
    monkeypatch.setattr(library_module, "_chosen", [Library(amx, None, "QVL_NATIVE=0")])
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=1, weights="int8"))
    assert engine.model.dtype == torch.bfloat16 and not vision_layers(engine) and engine.int8_activations == "off"


@pytest.mark.slow  # builds other tiers' libraries
def test_contradictory_options_are_refused(monkeypatch, tiny_checkpoint, tier_kernels):
    with pytest.raises(ValueError, match="need its int8 weights"):
        load_on(monkeypatch, tier_kernels("avx2"), tiny_checkpoint, weights="int8", vision_int8=False,
                int8_activations="vision")
    with pytest.raises(ValueError, match="int8 activations must be one of"):
        load_on(monkeypatch, tier_kernels("avx2"), tiny_checkpoint, weights="int8", int8_activations="yes")
    # auto with the vision tower kept float: nothing to run int8 x int8 there; prefill's codes stay
    engine = load_on(monkeypatch, tier_kernels("avx512-nobf16"), tiny_checkpoint, weights="int8", vision_int8=False)
    assert not vision_layers(engine) and engine.int8_activations == "all"
    assert all(byte_codes(m) for m in text_layers(engine) if m is not engine.model.lm_head)
    engine = load_on(monkeypatch, tier_kernels("avx2"), tiny_checkpoint, weights="int8", vision_int8=False)
    assert not vision_layers(engine) and engine.int8_activations == "off"


@pytest.mark.slow  # builds other tiers' libraries
def test_smoothed_int8_vision_stays_close_to_float_and_reloads_identically(monkeypatch, tiny_checkpoint,
                                                                          tier_kernels):
    """Image features of the int8 vision tower (smoothed, int8 x int8 products) against the
    float tower, cosine > 0.999; the second start loads the quantised-weights cache (norms
    divided by the smoothing scales kept in float32) and computes bit-identical features."""
    k = tier_kernels("avx512-nobf16")
    reference = features(load_on(monkeypatch, k, tiny_checkpoint, weights="int8", vision_int8=False))
    first = load_on(monkeypatch, k, tiny_checkpoint, weights="int8")
    second = load_on(monkeypatch, k, tiny_checkpoint, weights="int8")  # from the cache this time
    a, b = features(first), features(second)
    assert F.cosine_similarity(a.flatten(), reference.flatten(), 0) > 0.999
    assert torch.equal(a, b)
    norm = second.model.visual.blocks[0].norm1.weight
    assert norm.dtype == torch.float32 and not torch.equal(norm, norm.bfloat16().float())  # smoothed, unrounded


def test_smoothing_is_recorded_and_old_files_load_unsmoothed(tmp_path, tiny_checkpoint):
    from qvl.config import ModelConfig
    from qvl.weights import checkpoint_quantization, load_model, save_quantized

    spec = QuantSpec("int8", vision=True)
    assert spec.smoothing == "data-free" and QuantSpec("int8").smoothing == "none"
    out = save_quantized(tiny_checkpoint, tmp_path / "q", spec)
    assert checkpoint_quantization(out) == spec
    old = {"qvl_weights": "int8", "qvl_group_size": "128", "qvl_vision_int8": "true"}  # before smoothing existed
    assert QuantSpec.from_metadata(old).smoothing == "none"
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    plain = load_model(tiny_checkpoint, cfg, torch.bfloat16, QuantSpec("int8", vision=True, smoothing="none"))
    smoothed = load_model(out, cfg, torch.bfloat16)
    assert torch.equal(plain.visual.blocks[0].norm1.weight, load_model(tiny_checkpoint, cfg, torch.bfloat16)
                       .visual.blocks[0].norm1.weight)  # "none": the norms as the checkpoint has them
    assert not torch.equal(plain.visual.blocks[0].norm1.weight, smoothed.visual.blocks[0].norm1.weight)
    with pytest.raises(ValueError, match="smoothing must be one of"):
        QuantSpec("int8", vision=True, smoothing="magic")


def test_calibrated_smoothing_through_qvl_quantize(tmp_path, tiny_checkpoint, capsys):
    """`qvl quantize --vision-int8 --calibrate DIR`: the vision tower smoothed from the images'
    activations, recorded as such; the file loads as it is and stays close to float."""
    from qvl.bench import synthetic_image
    from qvl.cli import main
    from qvl.config import ModelConfig
    from qvl.weights import CheckpointError, checkpoint_quantization, load_model

    images = tmp_path / "calibration"
    images.mkdir()
    for i, size in enumerate(((96, 64), (64, 96), (80, 80))):
        synthetic_image(*size, seed=i).save(images / f"{i}.png")
    (images / "notes.txt").write_text("not an image")
    out = tmp_path / "calibrated"
    assert main(["quantize", str(tiny_checkpoint), str(out), "--weights", "int8", "--vision-int8",
                 "--calibrate", str(images)]) == 0
    assert "smoothed from 3 images" in capsys.readouterr().out
    spec = checkpoint_quantization(out)
    assert spec.vision and spec.smoothing == "calibrated"
    cfg = ModelConfig.from_file(tiny_checkpoint / "config.json")
    calibrated, data_free, reference = (load_model(out, cfg, torch.float32),
                                        load_model(tiny_checkpoint, cfg, torch.float32, QuantSpec("int8", vision=True)),
                                        load_model(tiny_checkpoint, cfg, torch.float32))
    assert not torch.allclose(calibrated.visual.blocks[0].norm1.weight, data_free.visual.blocks[0].norm1.weight)
    torch.manual_seed(0)
    patches = torch.randn(64, cfg.vision.patch_dim)
    with torch.inference_mode():
        got, want = (m.encode_images(patches, [(1, 8, 8)])[0] for m in (calibrated, reference))
    assert F.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.999

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "x"), "--weights", "int8", "--vision-int8",
                 "--calibrate", str(empty)]) != 0
    assert "no images there" in capsys.readouterr().err
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "y"), "--weights", "int8",
                 "--calibrate", str(images)]) != 0
    assert "--vision-int8" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="needs images"):
        load_model(tiny_checkpoint, cfg, torch.float32, QuantSpec("int8", vision=True, smoothing="calibrated"))


@pytest.mark.slow  # builds other tiers' libraries
def test_float32_tiers_vision_attention_in_integer_codes(monkeypatch, tmp_path, tier_kernels):
    """Where the vision tower's linears run int8 x int8 in float32 compute (plain AVX2 here), its
    attention runs in 16-bit integer codes too (qvl_attention_i16; the tiny tower with one head of
    64, a size the kernel takes): on the tower's own q, k and v it is closer to float64 than bf16
    attention (what the bf16 tiers run) is, and the image features stay at cosine 0.999 of the
    same tower with torch's float32 SDPA; without int8 x int8 linears the tower keeps SDPA."""
    from qvl.synth import write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "one-head", "tiny", seed=3, changes={"vision_config": {"num_heads": 1}})
    engine = load_on(monkeypatch, tier_kernels("avx2"), checkpoint, weights="int8")
    assert engine.model.dtype == torch.float32 and all(int8x8(m) for m in vision_layers(engine))
    from qvl.model.rope import apply_rotary

    run, calls = attention.attention_i16, []
    monkeypatch.setattr(attention, "attention_i16", lambda *a: calls.append(a[1:]) or run(*a))
    integer = features(engine)
    assert len(calls) == engine.cfg.vision.depth and all(q.shape[-1] == 64 for q, *_ in calls)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)

    for q, k, v, cos, sin in calls:  # q and k as the tower gives them, rotated by the kernel
        q_rot, k_rot = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        exact = sdpa(q_rot.double(), k_rot.double(), v.double())
        bf16 = sdpa(q_rot.bfloat16(), k_rot.bfloat16(), v.bfloat16()).double()
        ours = run(library().lib, q, k, v, cos, sin).double()
        assert (ours - exact).norm() < 0.5 * (bf16 - exact).norm()
    monkeypatch.setattr(attention, "attention_i16", lambda *a: None)  # declined: the float path takes over
    assert F.cosine_similarity(integer, features(engine), dim=-1).min() > 0.999
    calls.clear()
    monkeypatch.setattr(attention, "attention_i16", lambda *a: calls.append(a) or run(*a))
    features(load_on(monkeypatch, tier_kernels("avx2"), checkpoint, weights="int8", int8_activations="off"))
    assert not calls


def test_bf16_tiers_vision_attention_scores_in_byte_codes(monkeypatch, tmp_path):
    """On the default path of an AVX-512 CPU with VNNI and BF16 (no AMX), where the vision tower's
    linears run int8 x int8 in bf16, its attention runs in 8-bit codes (qvl_attention_q8;
    the tiny tower with one head of 64, a size the kernel takes): called once per block, the
    image features within cosine 0.999 of the same tower with the bf16 kernel; with
    --int8-activations off the tower keeps the bf16 kernel."""
    from qvl.synth import write_checkpoint

    chosen = library()
    if Plan.choose(chosen, torch.bfloat16, "int8").vision_attention != "qvl_attention_q8":
        pytest.skip("this CPU's default tier has no byte-code vision attention (needs AVX-512 VNNI + BF16, no AMX)")
    checkpoint = write_checkpoint(tmp_path / "one-head", "tiny", seed=3, changes={"vision_config": {"num_heads": 1}})
    engine = load_on(monkeypatch, chosen, checkpoint, weights="int8")
    assert engine.model.dtype == torch.bfloat16 and all(int8x8(m) for m in vision_layers(engine))
    run, calls = attention.attention_q8, []
    monkeypatch.setattr(attention, "attention_q8", lambda *a: calls.append(a[1:]) or run(*a))
    scores_in_codes = features(engine)
    assert len(calls) == engine.cfg.vision.depth and all(q.shape[-1] == 64 for q, *_ in calls)
    monkeypatch.setattr(attention, "attention_q8", lambda *a: None)  # declined: the bf16 kernel takes over
    assert F.cosine_similarity(scores_in_codes, features(engine), dim=-1).min() > 0.999
    calls.clear()
    monkeypatch.setattr(attention, "attention_q8", lambda *a: calls.append(a) or run(*a))
    features(load_on(monkeypatch, chosen, checkpoint, weights="int8", int8_activations="off"))
    assert not calls


def test_float32_compute_keeps_the_vision_weights_bf16(tiny_checkpoint):
    """CPUs without bf16 products compute in float32; asked to keep a float vision tower (its
    default there is int8), the int8 model keeps it bf16 in memory (as on the AVX-512 tier) and
    gives what float32 copies of the same weights give."""
    from qvl.engine import Engine, EngineOptions
    from qvl.quantize import Bf16StoredLinear

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8", dtype="fp32", threads=1,
                                       vision_int8=False))
    layers = [m for m in engine.model.visual.modules() if isinstance(m, Bf16StoredLinear)]
    assert layers and all(m.weight.dtype == torch.bfloat16 and m.bias.dtype == torch.float32 for m in layers)
    fc = layers[0]
    x = torch.randn(7, fc.in_features)
    torch.testing.assert_close(fc(x), F.linear(x, fc.weight.float(), fc.bias), atol=0, rtol=0)


def test_vision_codes_per_group(tiny_checkpoint):
    """Where the byte kernel runs, the vision tower's products take 8-bit codes per
    VISION_ACTIVATION_GROUP columns (plain AVX2's 7-bit codes per ACTIVATION_GROUP) and prefill's
    per ACTIVATION_GROUP (the plan's group reaches the kernel): a layer's output is the byte
    kernel's in exactly those codes."""
    from qvl.engine import Engine, EngineOptions
    from qvl.kernels import products

    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), weights="int8"))
    if not engine.plan.group_codes:
        pytest.skip("no byte kernel on this tier")
    wide = max(vision_layers(engine), key=lambda m: m.in_features)
    assert wide.in_features > linear.ACTIVATION_GROUP
    group = linear.VISION_ACTIVATION_GROUP if engine.plan.library.q8_code_bits == 8 else linear.ACTIVATION_GROUP
    assert {m.plan.prefill.group for m in vision_layers(engine)} == {group}
    assert {m.plan.prefill.group for m in text_layers(engine) if byte_codes(m)} == {linear.ACTIVATION_GROUP}
    x = torch.randn(40, wide.in_features).to(wide.scales.dtype)
    x[:, 3] *= 40  # an outlier channel: it coarsens the step of its group only
    with torch.inference_mode():
        y = products.int8_linear(wide, x)
    lib = library().lib
    other = linear.ACTIVATION_GROUP if group != linear.ACTIVATION_GROUP else linear.VISION_ACTIVATION_GROUP
    assert torch.equal(y, linear.q8_linear(lib, x, wide.weight, wide.scales, wide.bias, group))
    assert not torch.equal(y, linear.q8_linear(lib, x, wide.weight, wide.scales, wide.bias, other))
