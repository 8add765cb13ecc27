"""Where a model comes from: a local folder, the Hugging Face cache, or a download."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "merges.txt", "vocab.json"]


class ModelNotFound(RuntimeError):
    """The model cannot be found locally nor downloaded."""


def default_model() -> str:
    return os.environ.get("QVL_MODEL", DEFAULT_MODEL)


def resolve_model(name: str | os.PathLike | None = None) -> Path:
    """Local folder -> Hugging Face cache -> download; fail fast with what to do. A short
    name (qwen3-vl:2b) stands for its hub id."""
    from qvl.models import SHORT_NAMES

    name = str(name or default_model())
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelNotFound(f"{path} is a folder but holds no config.json: not a model checkpoint")
    if (found := local_model(name)) is not None:
        return found
    name = SHORT_NAMES.get(name.lower(), name)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelNotFound(f"model folder not found: {name}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=MODEL_FILES, etag_timeout=10))
    except Exception as exc:
        raise ModelNotFound(
            f"cannot get '{name}': not in the Hugging Face cache and the download failed "
            f"({type(exc).__name__}). Download it on a connected machine with "
            f"`qvl pull {name}` (or copy the folder and pass --model PATH), "
            f"or make an offline demo checkpoint with `qvl synth ./demo --preset 2b` and use --model ./demo"
        ) from None


def local_model(name: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint folder a name stands for without downloading anything: a folder holding
    config.json, or the model's snapshot in the Hugging Face cache; None when neither."""
    from qvl.models import SHORT_NAMES

    name = str(name or default_model())
    path = Path(name).expanduser()
    if path.is_dir():
        return path if (path / "config.json").exists() else None
    name = SHORT_NAMES.get(name.lower(), name)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=MODEL_FILES, local_files_only=True))
    except Exception:
        return None
