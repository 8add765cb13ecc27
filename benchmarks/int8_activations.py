"""How far int8 activations move image features and prompt logits from bf16, per scheme, on
an outlier stress checkpoint (`qvl synth --outliers`) and on a plain random one.

Schemes, all with int8 weights (per output channel) and bf16 compute:
  int8 weights        Engine.load(weights="int8", dtype="bf16") with the vision tower kept bf16
                      (float products everywhere; the default where oneDNN has no int8 GEMM)
  + vision int8       the vision tower's linears int8 too (--vision-int8), float products
  ... 7-bit act.      the vision tower int8 x int8 with activation codes 0..127, as Engine.load
                      does where oneDNN's int8 GEMM is exact only for those (no VNNI)
  vision ..., smoothed the defaults of the float32 tiers (Engine.load: the vision tower smoothed
                      data-free at load, then int8; float products, or int8 x int8 for it alone)
  int8 act            + vision int8 and int8 x int8 products (activations per row)
  + smooth data-free  SmoothQuant scales from the norms' weights (qvl.smoothing), then as above
  + smooth calibrated scales from activation absmax over calibration images (not the evaluated ones)
  + fp outliers       no smoothing; the input channels whose calibrated absmax is above 8x the
                      median channel's computed in float beside the int8 product (LLM.int8()-style)
Each is measured against bf16 weights: mean per-token cosine of the image features
(encode_images: merged + DeepStack), mean per-position cosine of the prompt logits, top-1
agreement of the next-token logits over the prompt positions; and top-1 agreement with int8
weights. Prints a markdown table.

    python benchmarks/int8_activations.py                       # tiny stress + tiny plain
    python benchmarks/int8_activations.py --model /work/ckpt/qvl-2b-outliers --max-image-tokens 64

--prefill-codes measures the float32 tiers' prefill instead: float32 compute, the vision tower
unquantised, prefill's int8 products dequantised for the float GEMM or in 16-bit activation codes
per row (qvl_i16_linear, the default there), and where the build has the byte kernel in its codes
per 64 columns (also simulated in float32 at 7 and 8 bits), against float32 compute with bf16
weights; with bf16 compute and int8 weights (what the bf16 tiers run) for scale.

--prefill-groups measures prefill's 8-bit activation codes per group of input columns (as
OpenVINO's CPU plugin quantises activations for int8 weights): bf16 compute, the defaults, where
the CPU has VNNI prefill's int8 products in qvl_q8_linear's 8-bit codes per 64 columns (or per
--groups 32, 128: the same kernel; "row": per row, simulated in float32) against 16-bit codes
per row (qvl_i16_linear, --int8-activations vision), all against bf16 weights. --noise adds both
schemes with their sums in float32 instead of exact integers: how far the scores move when
nothing but float rounding changes.

--vision-codes measures the vision tower's int8 x int8 products on a float32 tier with the byte
kernel: oneDNN's int8 GEMM with codes per row against the byte kernel's codes per 64 columns,
against float32 compute with bf16 weights.

--int4-prefill measures what prefill's activation codes cost int4 weights (qvl_q4_linear: 8-bit
codes per 64 columns) beside what this tier's codes cost int8 weights: each weight format with
the text decoder's prefill products dequantised for the float GEMM, then as the defaults run them,
in the tier's compute dtype, against float32 compute with bf16 weights.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qvl.bench import synthetic_image
from qvl.engine import Engine, EngineOptions, Request
from qvl.kernels import linear, products
from qvl.kernels.library import Library, library
from qvl.kernels.plan import Kernel, LinearPlan, Plan, default_plan, layer_kind
from qvl.generate import new_cache
from qvl.quantize import Int8Linear, QuantSpec, TiedQuantEmbedding, quantize_int8, quantized_linear_names
from qvl.smoothing import calibrate, outlier_channels, smooth, smooth_groups
from qvl.stream import Timings
from qvl.synth import write_checkpoint

PROMPTS = ("Describe this image in detail.", "What colours are in the picture? Answer in one word.",
           "Is there any text in this image?\nList it.")
EVAL_SIZES = ((448, 336), (320, 480), (512, 512))
CALIBRATION_SIZES = ((384, 384), (640, 360))
CALIBRATION_PROMPT = "Write a short caption for this picture, then list the three most visible things."
FP_OUTLIER_RATIO = 8.0


@dataclass
class Output:
    features: list[torch.Tensor]  # per sample: [n, D] float32 (merged and DeepStack rows stacked)
    logits: list[torch.Tensor]  # per sample: [T, V] float32


def eval_sizes(n: int) -> list[tuple[int, int]]:
    """n evaluation image sizes: EVAL_SIZES in turn (each image has its own seed)."""
    return [EVAL_SIZES[i % len(EVAL_SIZES)] for i in range(n)]


def samples(sizes, prompts, seed: int, max_image_tokens: int) -> list[Request]:
    return [Request([{"role": "user", "content": [{"type": "image", "image": synthetic_image(w, h, seed + i)},
                                                  {"type": "text", "text": prompts[i % len(prompts)]}]}],
                    max_image_tokens=max_image_tokens)
            for i, (w, h) in enumerate(sizes)]


@torch.inference_mode()
def run(engine: Engine, requests: list[Request]) -> Output:
    """Image features and the logits at every prompt position, through the engine's own
    parsing, vision and M-RoPE layout (no caches)."""
    model, out = engine.model, Output([], [])
    for request in requests:
        parsed = engine.parse(request)
        prompt = engine.prepare(parsed, Timings(), use_cache=False)
        out.features.append(torch.cat([prompt.image_embeds, *prompt.deepstack]).float())
        ids = prompt.ids[None]
        h = model.embed(ids, prompt.image_embeds)
        cos, sin = model.rope(prompt.positions[:, None])
        cache = new_cache(model, 1, ids.shape[1])
        vis = ids == model.cfg.image_token_id
        h = model.language_model(h, cos, sin, cache, 0, vis, prompt.deepstack)
        out.logits.append(model.logits(h)[0].float())
    return out


def row_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(mean, min) per-row cosine over all samples."""
    c = torch.cat([F.cosine_similarity(x, y, dim=-1) for x, y in zip(a, b)])
    return c.mean().item(), c.min().item()


def top1(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return torch.cat([x.argmax(-1) == y.argmax(-1) for x, y in zip(a, b)]).float().mean().item()


# -- building the variants ----------------------------------------------------------------

class FloatOutlierLinear(Int8Linear):
    """Int8Linear whose listed input channels are computed in float beside the int8 product
    (their int8 weight columns zeroed): y = int8(x without them) + x[:, ch] @ W[:, ch].T."""

    channels: torch.Tensor
    float_columns: torch.Tensor  # [O, len(channels)] in the compute dtype

    def forward(self, x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
        x_rest = x.clone()
        x_rest[..., self.channels] = 0
        y = super().forward(x_rest) + x[..., self.channels] @ self.float_columns.T
        return F.gelu(y, approximate="tanh") if gelu_tanh else y


def packed_plan(module: Int8Linear, bits: int, keep_weight: bool) -> None:
    """The layer's many-row products int8 x int8 through oneDNN's GEMM in `bits`-bit codes per row
    (what the plan gives the tower where oneDNN multiplies), its decoding too unless keep_weight."""
    many = Kernel("onednn_int8", bits, module.scales.dtype)
    plan = module.plan
    module.plan = LinearPlan(plan.decode if keep_weight else many, many, plan.decode_rows, plan.prompt_rows)
    products.pack(module, keep_weight)


def codes_plan(engine: Engine, on: bool) -> None:
    """The engine's layers in the byte kernel's codes (its plan) or, off, in 16-bit codes per row."""
    plan = engine.plan
    (plan if on else Plan(plan.library, plan.dtype, plan.weights, plan.vision_int8, "off")).apply(engine.model)


def quantize_in_place(model, int8_activations: bool, float_channels: dict[str, torch.Tensor] | None = None):
    """What weights.load_model does for --weights int8 --vision-int8 (every text and vision
    linear -> Int8Linear, tied embeddings read from the quantised head), on an already loaded
    float model, so smoothing can be folded in first."""
    dtype = model.dtype
    for name in quantized_linear_names(model, QuantSpec("int8", vision=True)):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        w = old.weight.detach().float()
        channels = (float_channels or {}).get(name)
        cls = FloatOutlierLinear if channels is not None and len(channels) else Int8Linear
        new = cls(old.in_features, old.out_features, old.bias is not None, dtype)
        if cls is FloatOutlierLinear:
            new.channels, new.float_columns = channels, w[:, channels].to(dtype)
            w = w.clone()
            w[:, channels] = 0
        new.weight, scales = quantize_int8(w)
        new.scales = scales.to(dtype)
        if old.bias is not None:
            new.bias = old.bias.detach().to(dtype)
        new.use_plan(default_plan(dtype), layer_kind(name))
        if int8_activations:
            packed_plan(new, 8 if library().int8_levels == 255 else 7, keep_weight=True)
        setattr(parent, attr, new)
    if model.cfg.tie_word_embeddings:
        model.language_model.embed_tokens = TiedQuantEmbedding(model.lm_head)
    model.language_model.step_args = None
    return model


def variant(engine: Engine, model) -> Engine:
    """The engine's tokenizer, template and processor over another model."""
    other = copy.copy(engine)
    other.model = model
    return other


def agreement(out: Output, ref: Output, base: Output | None, note: str = "") -> dict:
    """One table row: out's image features and prompt logits against the reference's, and its
    top-1 agreement with the reference and with `base` (1.0 while there is none)."""
    feat, feat_min = row_cosine(out.features, ref.features)
    logit, _ = row_cosine(out.logits, ref.logits)
    return {"feat": feat, "feat_min": feat_min, "logits": logit, "top1": top1(out.logits, ref.logits),
            "top1_w8": top1(out.logits, base.logits) if base else 1.0, "note": note}


# -- one checkpoint -----------------------------------------------------------------------

def measure(path: Path, args) -> list[tuple[str, dict]]:
    common = dict(model=str(path), threads=args.threads, quant_cache=False)
    evaluation = samples(eval_sizes(args.images), PROMPTS, 0, args.max_image_tokens)
    calibration = samples(CALIBRATION_SIZES, (CALIBRATION_PROMPT,), 1000, args.max_image_tokens)
    rows = []

    started = time.perf_counter()
    bf16 = Engine.load(EngineOptions(**common, weights="bf16"))
    ref = run(bf16, evaluation)
    print(f"  bf16 reference: {time.perf_counter() - started:.1f} s", file=sys.stderr)

    def record(name: str, out: Output, note: str = "") -> None:
        rows.append((name, agreement(out, ref, base, note)))
        print(f"  {name}: {rows[-1][1]} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)

    base = None
    engine = Engine.load(EngineOptions(**common, weights="int8", dtype="bf16", vision_int8=False,
                                       int8_activations="off"))
    base = run(engine, evaluation)
    del engine
    record("int8 weights, vision bf16", base)

    vision = "vision int8 x int8, 8-bit codes per 64 columns, smoothed (default: VNNI, AVX-VNNI)" \
        if default_plan(torch.bfloat16).group_codes else "vision int8 x int8, smoothed (default here)"
    for name, acts in (("vision int8 weights, smoothed (default: float32 tiers without int8 products)", "off"),
                       (vision, "vision")):
        engine = Engine.load(EngineOptions(**common, weights="int8", dtype="bf16", vision_int8=True,
                                           int8_activations=acts))  # the loading path's own smoothing
        record(name, run(engine, evaluation))
        del engine
    for levels, name in ((255, "vision int8 x int8, 8-bit codes per row, smoothed (default: AMX)"),
                         (127, "vision int8 x int8, 7-bit codes per row, smoothed (default: AVX-512 without VNNI)")):
        engine = Engine.load(EngineOptions(**common, weights="int8", dtype="bf16", vision_int8=True,
                                           int8_activations="off"))
        for module_name, module in engine.model.named_modules():
            if isinstance(module, Int8Linear) and module_name.startswith("visual."):
                packed_plan(module, 8 if levels == 255 else 7, keep_weight=False)  # where oneDNN multiplies
        record(name, run(engine, evaluation))
        del engine

    stats = calibrate(bf16.model, lambda: run(bf16, calibration))
    model = quantize_in_place(copy.deepcopy(bf16.model), False)
    record("int8 weights + vision int8", run(variant(bf16, model), evaluation))
    del model
    builds = [
        ("int8 act", lambda m: None),
        ("int8 act + smooth data-free", lambda m: smooth(m, alpha=args.alpha)),
        ("int8 act + smooth calibrated", lambda m: smooth(m, stats, alpha=args.alpha)),
    ]
    for name, prepare in builds:
        model = copy.deepcopy(bf16.model)
        prepare(model)
        record(name, run(variant(bf16, quantize_in_place(model, True)), evaluation))
        del model
        gc.collect()
    if args.fp_outliers:
        consumers = {g.key: g.consumers for g in smooth_groups(bf16.model)}
        keep = {linear: c for key, c in outlier_channels(stats, FP_OUTLIER_RATIO).items() if len(c)
                for linear in consumers[key]}
        note = f"{sum(len(c) for c in keep.values())} channels over {len(keep)} linears"
        model = quantize_in_place(copy.deepcopy(bf16.model), True, keep)
        record("int8 act + fp outliers", run(variant(bf16, model), evaluation), note)
    return rows


class Rows(list):
    """Table rows (name, agreement) against `ref`; top-1 also against `base` once it is set."""

    def __init__(self, ref: Output):
        super().__init__()
        self.ref, self.base = ref, None

    def record(self, name: str, out: Output) -> None:
        self.append((name, agreement(out, self.ref, self.base)))
        print(f"  {name}: {self[-1][1]}", file=sys.stderr)


def measure_prefill_codes(path: Path, args) -> list[tuple[str, dict]]:
    """The float32 tiers' prefill products: dequantised weights against 16-bit activation codes."""
    common = dict(model=str(path), threads=args.threads, quant_cache=False, vision_int8=False,
                  int8_activations="off")
    evaluation = samples(eval_sizes(args.images), PROMPTS, 0, args.max_image_tokens)
    ref = run(Engine.load(EngineOptions(model=str(path), threads=args.threads, weights="bf16", dtype="fp32")),
              evaluation)
    rows = Rows(ref)
    i16_linear = linear.i16_linear
    linear.i16_linear = lambda *a, **k: None  # declined: prefill's products dequantised for the float GEMM
    try:
        rows.base = run(Engine.load(EngineOptions(**common, weights="int8", dtype="fp32")), evaluation)
    finally:
        linear.i16_linear = i16_linear
    rows.record("float32, int8 weights, prefill's products dequantised", rows.base)
    engine = Engine.load(EngineOptions(**common, weights="int8", dtype="fp32"))
    assert default_plan(torch.float32).pair_products, "qvl_i16_linear does not run on this CPU"
    rows.record("float32, int8 weights, prefill in 16-bit activation codes (the default)", run(engine, evaluation))
    del engine
    if default_plan(torch.float32).group_codes:  # the byte kernel: VNNI's 8-bit codes, plain AVX2's 7-bit
        levels = library().q8_levels
        engine = Engine.load(EngineOptions(**{**common, "int8_activations": "all"}, weights="int8", dtype="fp32"))
        rows.record(f"float32, int8 weights, prefill in codes -{levels}..{levels} per {linear.ACTIVATION_GROUP} "
                    "columns (the byte kernel)", run(engine, evaluation))
        q8_linear = linear.q8_linear
        for top in (63, 127):  # both code widths with the sums in float32, for scale
            linear.q8_linear = lambda lib, x, w, s, bias=None, top=top, **kw: simulated_codes(
                linear.ACTIVATION_GROUP, top)(lib, x, w, s, bias)
            try:
                rows.record(f"float32, int8 weights, prefill in codes -{top}..{top} per {linear.ACTIVATION_GROUP} "
                            "columns, simulated in float32", run(engine, evaluation))
            finally:
                linear.q8_linear = q8_linear
        del engine
    rows.record("bf16, int8 weights (the bf16 tiers)",
                run(Engine.load(EngineOptions(**common, weights="int8", dtype="bf16")), evaluation))
    return rows


def simulated_codes(group: int, top: int):
    """A product with symmetric activation codes (step max|x| / top per `group` columns, 0: per
    row) computed in float32: the kernels' numbers but for the float rounding of the sums."""
    def product(lib, x, weight, scales, bias=None):
        k = x.shape[-1]
        g = group or k
        xg = x.float().reshape(-1, k // g, g)
        step = xg.abs().amax(-1, keepdim=True) / top
        step = torch.where(step > 0, step, torch.ones_like(step))
        y = (torch.round(xg / step) * step).reshape(-1, k) @ (weight.float() * scales.float()[:, None]).T
        return (y if bias is None else y + bias.float()).to(x.dtype).reshape(*x.shape[:-1], -1)
    return product


def measure_prefill_groups(path: Path, args) -> list[tuple[str, dict]]:
    """Prefill's int8 products in 8-bit activation codes per group of input columns (the
    default where the CPU has VNNI: qvl_q8_linear) against 16-bit codes per row (qvl_i16_linear,
    --int8-activations vision), both against bf16 weights; with the products' distance."""

    common = dict(model=str(path), threads=args.threads, quant_cache=False)
    evaluation = samples(eval_sizes(args.images), PROMPTS, 0, args.max_image_tokens)
    ref = run(Engine.load(EngineOptions(**common, weights="bf16")), evaluation)
    rows = Rows(ref)
    engine = Engine.load(EngineOptions(**common, weights="int8"))
    assert default_plan(torch.bfloat16).group_codes, "qvl_q8_linear does not run on this CPU"
    assert engine.int8_activations == "all", "the defaults did not take 8-bit codes in prefill"
    groups = [0 if g == "row" else int(g) for g in args.groups.split(",")]
    i16_linear, q8_linear = linear.i16_linear, linear.q8_linear
    schemes = {g: (simulated_codes(0, 127) if g == 0 else
                   lambda lib, x, w, s, bias=None, g=g: q8_linear(lib, x, w, s, bias, group=g)) for g in groups}
    squares, total = {g: 0.0 for g in groups}, [0.0]

    def measured(lib, x, weight, scales, bias=None):  # 16-bit codes, and each scheme's distance to them
        y = i16_linear(lib, x, weight, scales, bias)
        yf = y.float()
        total[0] += yf.pow(2).sum().item()
        for g, product in schemes.items():
            squares[g] += (product(lib, x, weight, scales, bias).float() - yf).pow(2).sum().item()
        return y

    codes_plan(engine, False)
    linear.i16_linear = measured
    try:
        rows.base = run(engine, evaluation)
    finally:
        linear.i16_linear = i16_linear
        codes_plan(engine, True)
    rows.record("16-bit codes per row (--int8-activations vision)", rows.base)
    try:
        for g, product in schemes.items():
            linear.q8_linear = lambda lib, x, w, s, bias=None, group=0, product=product: product(lib, x, w, s, bias)
            per = f"{g} columns" + (" (the default)" if g == linear.ACTIVATION_GROUP else "") if g else \
                "row (simulated in float32)"
            rows.record(f"8-bit codes per {per}", run(engine, evaluation))
            rows[-1][1]["note"] = f"products' rms distance to 16-bit codes {(squares[g] / total[0]) ** 0.5:.4f}"
        if args.noise:  # the same schemes with the sums in float32: how far float rounding alone moves the scores
            for name, product, layer_codes in (("16-bit codes per row", simulated_codes(0, 32767), False),
                                               (f"8-bit codes per {linear.ACTIVATION_GROUP} columns",
                                                simulated_codes(linear.ACTIVATION_GROUP, 127), True)):
                codes_plan(engine, layer_codes)
                linear.i16_linear = linear.q8_linear = \
                    lambda lib, x, w, s, bias=None, group=0, product=product: product(lib, x, w, s, bias)
                rows.record(f"{name}, simulated in float32", run(engine, evaluation))
    finally:
        linear.i16_linear, linear.q8_linear = i16_linear, q8_linear
        codes_plan(engine, True)
    return rows


@contextlib.contextmanager
def float_prefill(engine: Engine):
    """Within it, the text decoder's quantised linears run their many-row products dequantised
    for the float GEMM (the tower and decoding as planned)."""
    layers = [m for n, m in engine.model.named_modules()
              if layer_kind(n) == "text" and isinstance(m.__dict__.get("plan"), LinearPlan)]
    plans = [m.plan for m in layers]
    for m in layers:
        m.plan = dataclasses.replace(m.plan, prefill=Kernel("dequantize", 0, m.plan.prefill.dtype))
    try:
        yield
    finally:
        for m, plan in zip(layers, plans):
            m.plan = plan


def measure_int4_prefill(path: Path, args) -> list[tuple[str, dict]]:
    """int4 and int8 weights, prefill's products dequantised and in the tier's activation codes,
    against float32 compute with bf16 weights."""
    common = dict(model=str(path), threads=args.threads, quant_cache=False)
    evaluation = samples(eval_sizes(args.images), PROMPTS, 0, args.max_image_tokens)
    rows = Rows(run(Engine.load(EngineOptions(**common, weights="bf16", dtype="fp32")), evaluation))
    for weights in ("int8", "int4"):
        engine = Engine.load(EngineOptions(**common, weights=weights))
        kernel = engine.plan.entries()["text linears, prefill"]
        with float_prefill(engine):
            out = run(engine, evaluation)
        if rows.base is None:  # int8 weights' float prefill: the "top-1 vs int8 weights" column's reference
            rows.base = out
        dtype = str(engine.plan.dtype).removeprefix("torch.")
        rows.record(f"{weights} weights ({dtype}), prefill's products dequantised", out)
        rows.record(f"{weights} weights, prefill in {kernel.name} ({kernel.code_bits}-bit codes, the default)",
                    run(engine, evaluation))
        del engine
    return rows


def measure_vision_codes(path: Path, args) -> list[tuple[str, dict]]:
    """The vision tower's int8 x int8 products on this tier (float32 compute, prefill as the
    defaults): oneDNN's int8 GEMM with codes per row against qvl's byte kernel with codes per
    linear.ACTIVATION_GROUP columns, against float32 compute with bf16 weights."""
    common = dict(model=str(path), threads=args.threads, quant_cache=False, dtype="fp32")
    evaluation = samples(eval_sizes(args.images), PROMPTS, 0, args.max_image_tokens)
    ref = run(Engine.load(EngineOptions(**common, weights="bf16")), evaluation)
    rows = Rows(ref)
    rows.base = run(Engine.load(EngineOptions(**common, weights="int8", int8_activations="off")), evaluation)
    rows.record("int8 vision weights, float products", rows.base)
    k = library()
    assert default_plan(torch.float32).group_codes, "qvl's byte kernel does not run on this tier"
    levels = k.q8_levels
    with without_byte_kernel():
        engine = Engine.load(EngineOptions(**common, weights="int8", int8_activations="vision"))
    rows.record(f"the tower in oneDNN's codes 0..{k.int8_levels} per row", run(engine, evaluation))
    engine = Engine.load(EngineOptions(**common, weights="int8", int8_activations="vision"))
    assert all(m.plan.prefill.name == "q8_linear" for n, m in engine.model.named_modules()
               if n.startswith("visual.") and isinstance(m, Int8Linear))
    rows.record(f"the tower in the byte kernel's codes -{levels}..{levels} per {linear.ACTIVATION_GROUP} columns",
                run(engine, evaluation))
    return rows


@contextlib.contextmanager
def without_byte_kernel():
    """Within it, the plan sees no byte kernel (as a build without one: AVX-512 without VNNI), so
    engines loaded there run the vision tower's int8 x int8 products through oneDNN's GEMM."""
    byte_kernel = Library.q8_levels
    Library.q8_levels = property(lambda self: 0)
    try:
        yield
    finally:
        Library.q8_levels = byte_kernel


def table(results: dict[str, list[tuple[str, dict]]]) -> str:
    lines = ["| checkpoint | scheme | image features cos (mean / min) | prompt logits cos | top-1 vs bf16 "
             "| top-1 vs int8 weights |", "|---|---|---|---|---|---|"]
    for ckpt, rows in results.items():
        for name, r in rows:
            lines.append(f"| {ckpt} | {name}{' (' + r['note'] + ')' if r['note'] else ''} | {r['feat']:.5f} / "
                         f"{r['feat_min']:.4f} | {r['logits']:.5f} | {r['top1']:.3f} | {r['top1_w8']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="checkpoint folder(s) (default: tiny stress + tiny plain, "
                        "written to a temporary folder)")
    parser.add_argument("--max-image-tokens", type=int, default=256)
    parser.add_argument("--images", type=int, default=3, help="evaluation images (their sizes cycle through 3)")
    parser.add_argument("--groups", default="64,32,128,row", help="with --prefill-groups: the group sizes")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.add_argument("--fp-outliers", action="store_true", help="also the LLM.int8()-style scheme")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-codes", action="store_true", help="the float32 tiers' prefill products (see above)")
    parser.add_argument("--prefill-groups", action="store_true", help="prefill in 8-bit codes per group (see above)")
    parser.add_argument("--vision-codes", action="store_true", help="the vision tower's int8 x int8 products: "
                        "oneDNN's codes per row against the byte kernel's per group (float32 tiers)")
    parser.add_argument("--int4-prefill", action="store_true", help="what prefill's activation codes cost int4 "
                        "weights beside int8's (see above)")
    parser.add_argument("--noise", action="store_true", help="with --prefill-groups: also 16-bit and 8-bit codes "
                        "with the sums in float32 (how far the scores move with float rounding alone)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="qvl-int8act-") as tmp:
        paths = [Path(p) for p in args.model] if args.model else [
            write_checkpoint(Path(tmp) / "tiny-outliers", "tiny", seed=0, outliers=True),
            write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)]
        results = {}
        for path in paths:
            print(f"{path}:", file=sys.stderr)
            how = (measure_prefill_codes if args.prefill_codes else measure_prefill_groups if args.prefill_groups
                   else measure_vision_codes if args.vision_codes else measure_int4_prefill if args.int4_prefill
                   else measure)
            results[path.name] = how(path, args)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
