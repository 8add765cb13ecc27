"""Checkpoint loading: safetensors (single file or sharded index), memory-mapped,
strict, keeping Hugging Face parameter names."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from qvl import mapped, smoothing
from qvl.config import ModelConfig
from qvl.kernels.plan import default_plan
from qvl.paths import cache_root
from qvl.model.qwen3_vl import Qwen3VL
from qvl.quantize import (
    Int4Experts,
    Int4Linear,
    Int8Experts,
    Int8Linear,
    QuantSpec,
    TiedQuantEmbedding,
    keep_bf16_storage,
    portable_quantized,
    portable_state,
    quantize_vision,
    quantized_state,
    state_from_portable,
    swap_modules,
    use_decode_kernels,
)

# checkpoint name prefix -> module attribute prefix; the whole renaming table.
NAME_PREFIXES = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("lm_head.", "lm_head."),
)


QUANT_LAYOUT_VERSION = "2"  # bump when the portable quantised layout changes


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold the tensors the config describes."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, sharded or not."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


MTP_PREFIX = "mtp."  # Qwen3.5's multi-token-prediction head: kept as stored (Qwen3VL.mtp), not a module


def to_module_name(name: str) -> str | None:
    for src, dst in NAME_PREFIXES:
        if name.startswith(src):
            return dst + name[len(src) :]
    return None


def iter_tensors(files: list[Path], cfg: ModelConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor, read lazily through mmap; with the config of
    a Qwen3.5 mixture, its experts in Qwen3-VL's fused layout (see fused_experts)."""
    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return fused_experts(read(), cfg.text.num_experts) if cfg is not None and cfg.model_type == "qwen3_5_moe" \
        else read()


EXPERT_NAME = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fused_experts(tensors: Iterator[tuple[str, torch.Tensor]], experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A Qwen3.5 mixture's experts -> Qwen3-VL's fused layout (`mlp.experts.gate_up_proj`
    [E, H, 2I], gate first; `mlp.experts.down_proj` [E, I, H]), which qvl's modules take. The
    published files fuse them the other way round ([E, 2I, H] and [E, H, I]: transposed here);
    experts stored one by one (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H],
    `down_proj` [H, I], as transformers splits them on save) are fused once a layer's have all
    come (a layer missing one is a CheckpointError naming it). Other tensors pass as they are."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        if name.startswith(MTP_PREFIX):  # its own experts stay as stored (Qwen3VL.mtp)
            yield name, tensor
            continue
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield name, tensor.transpose(1, 2)
            continue
        match = EXPERT_NAME.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, leaf = match.group(1), int(match.group(2)), match.group(3)
        parts = pending.setdefault(prefix, {})
        parts[expert, leaf] = tensor
        if len(parts) == 3 * experts and all((e, leaf) in parts for e in range(experts)
                                             for leaf in ("gate_proj", "up_proj", "down_proj")):
            del pending[prefix]
            yield f"{prefix}.gate_up_proj", torch.stack(
                [torch.cat([parts[e, "gate_proj"].t(), parts[e, "up_proj"].t()], dim=1) for e in range(experts)])
            yield f"{prefix}.down_proj", torch.stack([parts[e, "down_proj"].t() for e in range(experts)])
    for prefix, parts in pending.items():
        have = {e for e, _ in parts}
        raise CheckpointError(f"{prefix}: the experts stored one by one are incomplete ({len(parts)} tensors for "
                              f"experts {min(have)}..{max(have)}; each of the {experts} needs gate_proj, up_proj and "
                              f"down_proj)")


def read_metadata(files: list[Path]) -> dict[str, str]:
    with safe_open(str(files[0]), framework="pt") as f:
        return f.metadata() or {}


def checkpoint_quantization(model_dir: Path) -> QuantSpec | None:
    """The weight format a pre-quantised checkpoint records in its safetensors metadata."""
    return QuantSpec.from_metadata(read_metadata(checkpoint_files(model_dir)))


@contextmanager
def skipped_init():
    """Build modules without their random initialisation (every parameter is loaded right
    after). On the meta device torch's `normal_` alone imports ~800 modules (sympy, mpmath,
    torch._refs...): ~70 MB of memory that stays for the life of the process."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, quant: QuantSpec | None = None,
               dequantise: bool = False) -> Qwen3VL:
    """Build the model without initialising weights and fill it tensor by tensor from
    the checkpoint, converting (or quantising) each on the way: never a second full copy.
    A pre-quantised checkpoint loads as it is; its layers get the dtype's default kernel plan.
    With `dequantise`, a pre-quantised int8 checkpoint's values load as float weights instead
    (then as `quant` asks). Missing or unexpected tensors raise CheckpointError listing them."""
    files = checkpoint_files(model_dir)
    stored = QuantSpec.from_metadata(read_metadata(files))
    tensors = iter_tensors(files, cfg)
    if dequantise and stored is not None:
        if stored.weights != "int8":
            raise CheckpointError(f"{model_dir} holds pre-quantised {stored.weights} weights: only int8 ones "
                                  "can load as another format")
        tensors, stored = dequantised(tensors, cfg.tie_word_embeddings), None
    if stored is not None and quant is not None and quant != stored:
        raise CheckpointError(
            f"{model_dir} holds pre-quantised {stored.weights} weights; load it with --weights {stored.weights} "
            f"or quantise the original bf16 checkpoint instead")
    spec = stored or quant
    # a new int8 vision tower is loaded in float, smoothed, then quantised (files hold it done)
    smooth_vision = stored is None and spec is not None and spec.vision and spec.smoothing != "none"
    if smooth_vision and spec.smoothing != "data-free":
        raise CheckpointError(f"{spec.smoothing} smoothing needs images: write the checkpoint with "
                              "`qvl quantize --calibrate DIR`")
    with torch.device("meta"), skipped_init():
        model = Qwen3VL(cfg)
        quantized = set(swap_modules(model, replace(spec, vision=False) if smooth_vision else spec, dtype)) \
            if spec else set()
        use_decode_kernels(model)
        # float32 compute of a quantised model (CPUs without bf16 products): its float vision tower stays bf16
        kept_bf16 = keep_bf16_storage(model) if spec and dtype == torch.float32 else set()
        tied_quant = cfg.tie_word_embeddings and "lm_head" in quantized
        if tied_quant:
            model.language_model.embed_tokens = TiedQuantEmbedding(model.lm_head)
    source = _TensorSource(model, quantized, tied_quant, dtype, from_portable=stored is not None, kept_bf16=kept_bf16)
    for name, tensor in tensors:
        source.add(name, tensor)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings and not tied_quant:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(source.state))
    unexpected = source.unexpected + sorted(set(source.state) - expected)
    if missing or unexpected:
        raise CheckpointError(_mismatch_message(missing, unexpected))
    _check_shapes(model, source.state)
    model.load_state_dict(source.state, strict=False, assign=True)
    if smooth_vision:
        smoothing.smooth(model, text=False, vision=True)
        quantize_vision(model, dtype)
    model.init_buffers()
    if not tied_quant:
        model.tie_weights()
    default_plan(dtype).apply(model)  # Engine.load gives its options' plan after
    return model.eval()


def dequantised(tensors: Iterator[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A pre-quantised int8 checkpoint's tensors as a float one's: each int8 `X.weight` times its
    `X.weight_scale` (one per output row), in float32; a tied head is named as the embedding it
    shares. Other tensors pass as they are."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        base, _, leaf = name.rpartition(".")
        if leaf not in ("weight", "weight_scale") or (leaf == "weight" and tensor.dtype != torch.int8):
            yield name, tensor
            continue
        parts = pending.setdefault(base, {})
        parts[leaf] = tensor
        if len(parts) == 2:
            del pending[base]
            weight = parts["weight"].float() * parts["weight_scale"].float().unsqueeze(-1)
            yield ("model.language_model.embed_tokens" if tied and base == "lm_head" else base) + ".weight", weight
    if pending:
        raise CheckpointError(f"int8 weights without their scales (or scales alone): {', '.join(sorted(pending))}")


class _TensorSource:
    """Turns checkpoint tensors into module state: renamed, converted, quantised."""

    def __init__(self, model: Qwen3VL, quantized: set[str], tied_quant: bool, dtype: torch.dtype,
                 from_portable: bool, kept_bf16: set[str]):
        self.model, self.quantized, self.tied_quant, self.kept_bf16 = model, quantized, tied_quant, kept_bf16
        self.dtype, self.from_portable = dtype, from_portable
        self.state: dict[str, torch.Tensor] = {}
        self.unexpected: list[str] = []
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # portable parts per module

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith(MTP_PREFIX):
            self.model.mtp[name] = tensor  # memory-mapped: costs nothing until used
            return
        target = to_module_name(name)
        if target is None:
            self.unexpected.append(name)
            return
        if self.tied_quant and target == "language_model.embed_tokens.weight":
            target = "lm_head.weight"  # the shared matrix is quantised once, as the head
        module_name, _, leaf = target.rpartition(".")
        if module_name not in self.quantized:
            if target == "lm_head.weight" and self.model.cfg.tie_word_embeddings:
                return  # a tied checkpoint may still carry the duplicate
            if tensor.is_floating_point():
                keep = target in self.kept_bf16 and tensor.dtype == torch.bfloat16
                tensor = tensor.to(torch.bfloat16 if keep else self.dtype)
            self.state[target] = tensor
            return
        module = self.model.get_submodule(module_name)
        if isinstance(module, (Int8Experts, Int4Experts)):
            self.state.update(module.state(module_name, leaf, tensor, self.dtype, stored=self.from_portable))
            return
        if not self.from_portable:
            if leaf == "weight":
                self.state.update(quantized_state(module, module_name, tensor, self.dtype))
            else:
                self.state[target] = tensor.to(self.dtype)
            return
        parts = self.pending.setdefault(module_name, {})
        parts[leaf] = tensor
        needed = {"weight", "weight_scale"} | ({"weight_zero"} if isinstance(module, Int4Linear) else set())
        if getattr(module, "bias", None) is not None:
            needed.add("bias")
        if needed <= parts.keys():
            self.state.update(state_from_portable(module, module_name, self.pending.pop(module_name), self.dtype))


def _check_shapes(model: Qwen3VL, state: dict[str, torch.Tensor]) -> None:
    _raise_wrong_shapes([_wrong_shape(k, state[k].shape, p.shape) for k, p in model.state_dict().items()
                         if k in state and tuple(state[k].shape) != tuple(p.shape)])


def _wrong_shape(name: str, found: tuple[int, ...], expected: tuple[int, ...]) -> str:
    return f"{name}: checkpoint {tuple(found)} vs config {tuple(expected)}"


def _raise_wrong_shapes(wrong: list[str]) -> None:
    if wrong:
        raise CheckpointError("tensor shapes do not match config.json:\n  " + "\n  ".join(wrong[:20]))


def _mismatch_message(missing: list[str], unexpected: list[str]) -> str:
    lines = []
    if missing:
        lines.append(f"{len(missing)} missing tensors: " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        lines.append(
            f"{len(unexpected)} unexpected tensors: " + ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else "")
        )
    return "checkpoint does not match config.json: " + "; ".join(lines)


def to_checkpoint_name(module_name: str) -> str:
    for src, dst in NAME_PREFIXES:
        if module_name.startswith(dst):
            return src + module_name[len(dst) :]
    raise ValueError(f"no checkpoint name for {module_name}")


def save_quantized(model_dir: Path, out_dir: Path, spec: QuantSpec,
                   calibration: list[tuple[torch.Tensor, tuple[int, int, int]]] | None = None) -> Path:
    """Quantise a bf16 checkpoint and write it (see write_quantized). With `calibration`
    (preprocessed images: patches [N, C*T*P*P] and grid), the int8 vision tower is smoothed
    from those images' activations instead of from its norms."""
    cfg = ModelConfig.from_file(model_dir / "config.json")
    if QuantSpec.from_metadata(read_metadata(checkpoint_files(model_dir))) is not None:
        raise CheckpointError(f"{model_dir} is already quantised; quantise the original bf16 checkpoint")
    if not calibration:
        return write_streamed(model_dir, out_dir, spec, torch.bfloat16)
    if not spec.vision:
        raise CheckpointError("calibration smooths the int8 vision tower: quantise it too (--vision-int8)")
    spec = replace(spec, smoothing="calibrated")
    model = load_model(model_dir, cfg, torch.bfloat16, replace(spec, vision=False))  # vision stays float

    def run() -> None:
        with torch.inference_mode():
            for patches, grid in calibration:
                model.encode_images(patches.to(torch.bfloat16), [grid])

    smoothing.smooth(model, smoothing.calibrate(model, run), text=False, vision=True)
    quantize_vision(model, torch.bfloat16)
    return write_quantized(model, spec, model_dir, out_dir)


def write_quantized(model: Qwen3VL, spec: QuantSpec, model_dir: Path, out_dir: Path) -> Path:
    """Write a quantised model as a checkpoint folder: HF names, quantised matrices in a
    portable layout, the format in the safetensors metadata; the other files (config,
    tokenizer, template, ...) copied from `model_dir`. Written to a temporary name first."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            for key, tensor in portable_state(module, name).items():
                state[to_checkpoint_name(key)] = tensor.contiguous()
    for name, tensor in model.state_dict().items():
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, (Int8Linear, Int4Linear)):
            continue
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        state[to_checkpoint_name(name)] = _stored(tensor).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_shards(iter(state.items()), out_dir, {"format": "pt", **spec.metadata()}, STREAMED_SHARD_BYTES)
    copy_side_files(model_dir, out_dir)
    return out_dir


def write_streamed(model_dir: Path, out_dir: Path, spec: QuantSpec, dtype: torch.dtype) -> Path:
    """The checkpoint write_quantized writes for `load_model(model_dir, cfg, dtype, spec)`,
    quantised tensor by tensor (quantized_tensors) into shards (write_shards): peak memory is
    a shard, not the model, so a 62 GB bf16 checkpoint quantises on a 24 GB machine."""
    cfg = ModelConfig.from_file(model_dir / "config.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() == model_dir.resolve():
        raise CheckpointError(f"{out_dir} is the checkpoint's own folder: write the quantised one elsewhere")
    tensors = quantized_tensors(iter_tensors(checkpoint_files(model_dir), cfg), cfg, spec, dtype)
    write_shards(tensors, out_dir, {"format": "pt", **spec.metadata()}, STREAMED_SHARD_BYTES)
    copy_side_files(model_dir, out_dir)  # last: a failed write leaves an earlier checkpoint there whole
    return out_dir


def copy_side_files(model_dir: Path, out_dir: Path) -> None:
    """Everything of a checkpoint folder but its weights (config, tokenizer, template, ...)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith(("model.safetensors", "model-")):
            shutil.copyfile(path, out_dir / path.name)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as a file keeps it: bf16 (the checkpoint's own dtype), unless that would
    round it (float32 norms divided by smoothing scales stay float32, so a model loaded from
    the file computes exactly as the one that wrote it)."""
    if not t.is_floating_point():  # int8 experts
        return t
    if t.dtype != torch.float32:
        return t.to(torch.bfloat16)
    b = t.to(torch.bfloat16)
    return b if torch.equal(b.float(), t) else t


def quantized_tensors(tensors: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig, spec: QuantSpec,
                      dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Float checkpoint tensors -> the tensors `write_quantized` writes for the model loaded with
    `spec` in `dtype` (scales in dtype), one at a time: the text decoder's linears and experts
    are quantised as they come, so a model of any size needs the memory of its largest tensor;
    an int8 vision tower is gathered (under 1 GB), smoothed from its norms, quantised, and
    comes last. Names and shapes are checked against the config as load_model does
    (CheckpointError, before the last tensor is given). Calibrated smoothing needs images:
    see save_quantized."""
    if spec.vision and spec.smoothing == "calibrated":
        raise CheckpointError("calibrated smoothing needs images: write the checkpoint with `qvl quantize --calibrate DIR`")
    with torch.device("meta"), skipped_init():
        model = Qwen3VL(cfg)
        shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}  # float, as the checkpoint holds them
        quantized = set(swap_modules(model, replace(spec, vision=False), dtype))
        kept_bf16 = keep_bf16_storage(model) if spec.vision and dtype == torch.float32 else set()  # as load_model
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    tied_quant = cfg.tie_word_embeddings and "lm_head" in quantized
    vision: dict[str, torch.Tensor] = {}
    seen, unexpected, wrong = set(), [], []
    for name, tensor in tensors:
        if name.startswith(MTP_PREFIX):
            yield name, _stored(tensor)  # kept as the checkpoint has it
            continue
        target = to_module_name(name)
        if target == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied checkpoint may still carry the duplicate
        if target not in shapes:
            unexpected.append(name)
            continue
        seen.add(target)
        if tuple(tensor.shape) != shapes[target]:
            wrong.append(_wrong_shape(target, tensor.shape, shapes[target]))
            continue
        if tied_quant and target == "language_model.embed_tokens.weight":
            target = "lm_head.weight"  # stored once, as the quantised head (see load_model)
        if spec.vision and target.startswith("visual."):
            keep = target in kept_bf16 and tensor.dtype == torch.bfloat16
            vision[target] = tensor.to(torch.bfloat16 if keep else dtype)
            continue
        module_name, _, leaf = target.rpartition(".")
        module = model.get_submodule(module_name) if module_name in quantized else None
        if isinstance(module, (Int8Experts, Int4Experts)):
            state = module.state(module_name, leaf, tensor, dtype, stored=False)
        elif module is not None and leaf == "weight":
            state = portable_quantized(module, module_name, tensor, dtype)
        else:  # float tensors (and a quantised linear's bias) as the loaded model holds them
            yield name, _stored(tensor.to(dtype)) if tensor.is_floating_point() else tensor
            continue
        mapped.release(tensor)  # a mapped checkpoint's pages of it are read for good
        del tensor
        for key in list(state):
            yield to_checkpoint_name(key), state.pop(key)
    missing = sorted(set(shapes) - seen)
    if missing or unexpected:
        raise CheckpointError(_mismatch_message(missing, unexpected))
    _raise_wrong_shapes(wrong)
    if spec.vision:
        yield from _int8_vision(model, vision, dtype, smooth=spec.smoothing != "none")


def _int8_vision(model: Qwen3VL, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 smooth: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The float vision tower's tensors (module names, all checked) -> its int8 checkpoint
    tensors, smoothed from its norms as load_model does; `model` is a meta model whose tower
    takes them."""
    model.visual.load_state_dict({k.removeprefix("visual."): t for k, t in state.items()}, assign=True)
    if smooth:
        smoothing.smooth(model, text=False, vision=True)
    quantize_vision(model, dtype)
    for name, module in model.visual.named_modules(prefix="visual"):
        if isinstance(module, Int8Linear):
            yield from ((to_checkpoint_name(k), t) for k, t in portable_state(module, name).items())
    for name, tensor in model.visual.state_dict(prefix="visual.").items():
        if not isinstance(model.get_submodule(name.rpartition(".")[0]), Int8Linear):
            yield to_checkpoint_name(name), _stored(tensor)


SHARD_BYTES = 4 << 30  # the official checkpoints' shard size
STREAMED_SHARD_BYTES = 1 << 30  # quantising at the first start: a shard is held in memory beside the mapped source


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, metadata: dict[str, str],
                 shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write a stream of tensors as safetensors shards of about `shard_bytes` (save_aligned,
    each holding `metadata`): one `model.safetensors`, or `model-0000i-of-0000N.safetensors`
    with the Hugging Face index (written last: a complete set has it). Only one shard is held
    in memory; on an error no partial file stays. Returns the files."""
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        fd, path = tempfile.mkstemp(dir=out_dir, prefix=".shard-", suffix=".partial")  # unique: writers never clash
        os.close(fd)
        parts.append((Path(path), list(shard)))
        save_aligned(shard, Path(path), metadata)
        shard.clear()

    size = 0
    try:
        for name, tensor in tensors:
            if shard and size + tensor.nbytes > shard_bytes:
                flush()
                size = 0
            shard[name] = tensor.contiguous()
            size += tensor.nbytes
        if shard or not parts:
            flush()
    except BaseException:
        shard.clear()
        for path, _ in parts:
            path.unlink(missing_ok=True)
        raise
    for stale in [*out_dir.glob("model-*-of-*.safetensors"), *out_dir.glob("model.safetensors*")]:
        stale.unlink()  # an earlier checkpoint's weights in the same folder
    if len(parts) == 1:
        os.replace(parts[0][0], out_dir / "model.safetensors")
        return [out_dir / "model.safetensors"]
    files, weight_map = [], {}
    for i, (path, names) in enumerate(parts):
        final = out_dir / f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(path, final)
        files.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    total = sum(f.stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    fd, partial = tempfile.mkstemp(dir=out_dir, prefix=".index-", suffix=".partial")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(index, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, out_dir / "model.safetensors.index.json")  # whole or absent: it marks a complete set
    return files


SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int8: "I8",
                     torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}
ALIGN = 64


def save_aligned(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file whose tensors start 64-byte aligned, so memory-mapped weights
    feed the CPU kernels without a copy: the header is padded with spaces (as the format
    allows) and tensors whose size is not a multiple of 64 bytes go last."""
    names = sorted(state, key=lambda n: state[n].nbytes % ALIGN != 0)  # stable: odd sizes last
    header, offset = {"__metadata__": metadata}, 0
    for name in names:
        t = state[name]
        header[name] = {"dtype": SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            if state[name].numel():
                f.write(state[name].contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


UNUSED_CACHE_DAYS = 30  # a quantised-weights entry no start has used for this long is removed


def prune_quantized_cache(current: Path, days: float = UNUSED_CACHE_DAYS) -> list[Path]:
    """Mark `current` (an entry of the quantised-weights cache) used now, and remove the
    entries beside it that no start has used for `days`: a replaced checkpoint, a format no
    longer asked for, an older layout (each is 1-30 GB). Returns the removed folders. A
    running process keeps reading an entry removed under it (POSIX keeps unlinked files that
    are open); where a file cannot be removed (Windows, open), it stays for the next start."""
    try:
        (current / ".used").touch()
        entries = [e for e in current.parent.iterdir() if e.is_dir() and e != current]
    except OSError:
        return []
    removed, cutoff = [], time.time() - days * 86400
    for entry in entries:
        used = entry / ".used"
        try:
            last = (used if used.exists() else entry).stat().st_mtime
        except OSError:
            continue
        if last < cutoff:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def quantized_cache_dir(model_dir: Path, spec: QuantSpec, dtype: torch.dtype) -> Path:
    """Where the int8/int4 version of a bf16 checkpoint is kept after the first load, so
    later starts skip quantising. Keyed by the format and by each file's content and change
    time: its size, safetensors header (names, shapes, offsets) and 32 evenly spread 4 KiB
    samples plus the last 4 KiB (a few milliseconds to read), and its ctime, which the
    kernel sets on every write and no one can set back (unlike the mtime)."""
    samples, sample_bytes = 32, 4096
    h = hashlib.sha256(f"{spec!r}|{dtype}|{QUANT_LAYOUT_VERSION}".encode())  # scales are stored in dtype
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            h.update(f"{st.st_size}|{st.st_ctime_ns}|".encode())
            head = f.read(8)
            if len(head) == 8:
                h.update(f.read(min(struct.unpack("<Q", head)[0], st.st_size)))
            for i in range(samples):
                f.seek(st.st_size * i // samples)
                h.update(f.read(sample_bytes))
            f.seek(max(0, st.st_size - sample_bytes))
            h.update(f.read())
    root = cache_root() / "quantized"
    return root / f"{model_dir.resolve().name}-{spec.weights}-{h.hexdigest()[:16]}"
