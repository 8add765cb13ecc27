"""Checkpoint loading: safetensors (single file or sharded index), memory-mapped,
strict, keeping Hugging Face parameter names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from qvl.config import ModelConfig
from qvl.model.qwen3_vl import Qwen3VL

# checkpoint name prefix -> module attribute prefix; the whole renaming table.
NAME_PREFIXES = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("lm_head.", "lm_head."),
)


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


def to_module_name(name: str) -> str | None:
    for src, dst in NAME_PREFIXES:
        if name.startswith(src):
            return dst + name[len(src) :]
    return None


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor, read lazily through mmap."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_metadata(files: list[Path]) -> dict[str, str]:
    with safe_open(str(files[0]), framework="pt") as f:
        return f.metadata() or {}


def load_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype) -> Qwen3VL:
    """Build the model without initialising weights and fill it tensor by tensor from
    the checkpoint, converting each to `dtype` on the way (never a second full copy).
    Missing or unexpected tensors raise CheckpointError listing them."""
    with torch.device("meta"):
        model = Qwen3VL(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    state, unexpected = {}, []
    for name, tensor in iter_tensors(checkpoint_files(model_dir)):
        target = to_module_name(name)
        if target == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied checkpoint may still carry the duplicate
        if target not in expected:
            unexpected.append(name)
            continue
        state[target] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    missing = sorted(expected - set(state))
    if missing or unexpected:
        raise CheckpointError(_mismatch_message(missing, unexpected))
    _check_shapes(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    model.init_buffers()
    model.tie_weights()
    return model.eval()


def _check_shapes(model: Qwen3VL, state: dict[str, torch.Tensor]) -> None:
    wrong = [
        f"{k}: checkpoint {tuple(v.shape)} vs config {tuple(p.shape)}"
        for k, p in model.state_dict().items()
        if k in state and tuple(state[k].shape) != tuple(p.shape)
    ]
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
