"""A trained demo checkpoint made small enough to ship inside the package.

The tied token embedding dominates a demo model (the Qwen3.5 tokenizer's 248,320 rows are
31.8 M of its ~35 M parameters), yet training only ever reads the rows of the tokens its
prompts and answers use; the other rows are only pushed down as the sampled softmax's
negatives. `pack` sets each of those rows to their mean (their logits then share one value,
below the trained tokens'), quantises the model as `qvl quantize --weights int8 --vision-int8`
does, and stores the weights xz-compressed: the identical rows cost nothing. The package's
loader (qvl.demo.shipped) unpacks them into qvl's cache once."""

from __future__ import annotations

import json
import lzma
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from qvl.quantize import QuantSpec
from qvl.weights import checkpoint_files, copy_side_files, save_quantized, write_shards

EMBEDDING = "model.language_model.embed_tokens.weight"
SIDE_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "chat_template.jinja")


def collapse_unused_rows(embedding: torch.Tensor, used: list[int]) -> torch.Tensor:
    """embedding [V, H] with every row not in `used` replaced by the mean of those rows."""
    keep = torch.zeros(embedding.shape[0], dtype=torch.bool)
    keep[torch.tensor(used, dtype=torch.long)] = True
    out = embedding.clone()
    out[~keep] = embedding[~keep].float().mean(0).to(embedding.dtype)
    return out


def pack(trained: Path, dest: Path) -> Path:
    """The trained bf16 checkpoint `trained` (with the token ids its training used, in
    train/used_tokens.json) -> `dest`: its side files and model.safetensors.xz."""
    used_file = trained / "train" / "used_tokens.json"
    if not used_file.is_file():
        raise FileNotFoundError(f"{used_file} is missing: pack takes the folder `python -m qvl.demo train` wrote")
    used = json.loads(used_file.read_text())
    with tempfile.TemporaryDirectory() as work:
        collapsed, quantised = Path(work) / "collapsed", Path(work) / "int8"
        collapsed.mkdir()
        for name in SIDE_FILES:  # not the tokenizer: the package rebuilds it (qvl.demo.shipped)
            shutil.copy(trained / name, collapsed / name)
        write_shards(_collapsed_tensors(trained, used), collapsed, {"format": "pt"})
        save_quantized(collapsed, quantised, QuantSpec("int8", 128, True))
        copy_side_files(quantised, dest)
        (weights,) = checkpoint_files(quantised)
        with open(weights, "rb") as src, lzma.open(dest / "model.safetensors.xz", "wb", preset=9) as out:
            shutil.copyfileobj(src, out)
    return dest


def _collapsed_tensors(trained: Path, used: list[int]):
    for path in checkpoint_files(trained):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, collapse_unused_rows(tensor, used) if name == EMBEDDING else tensor
