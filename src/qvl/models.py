"""Models by name: the short names qvl knows (`qwen3-vl:2b` -> `Qwen/Qwen3-VL-2B-Instruct`), the
models in the Hugging Face cache (with their quantised copies in qvl's cache), and removing
one. `qvl pull` (pull.py) puts models there; `qvl list` and `qvl rm`, Ollama's /api/pull and
/api/delete, and a server that serves several models read and change them here."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from qvl.config import SUPPORTED_MODEL_TYPES


@dataclass(frozen=True)
class Known:
    short: str  # what to type: qwen3-vl:2b
    hub_id: str  # Qwen/Qwen3-VL-2B-Instruct
    preset: str  # the `qvl synth` preset of the same architecture: what it needs, without a download


def _known() -> tuple[Known, ...]:
    vl = [Known(f"qwen3-vl:{size}{suffix}", f"Qwen/Qwen3-VL-{size.upper()}-{kind}", size)
          for size in ("2b", "4b", "8b", "32b", "30b-a3b")
          for kind, suffix in (("Instruct", ""), ("Thinking", "-thinking"))]
    hybrid = [Known(f"qwen{family}:{size}{suffix}", f"Qwen/Qwen{family}-{size.upper()}{base}", f"qwen3.5-{size}")
              for family, sizes in (("3.5", ("0.8b", "2b", "4b", "9b", "27b", "35b-a3b")), ("3.6", ("27b", "35b-a3b")))
              for size in sizes for base, suffix in (("", ""), ("-Base", "-base"))]
    return tuple(vl + hybrid)


KNOWN = _known()
SHORT_NAMES = {k.short: k.hub_id for k in KNOWN}


def hub_id(name: str) -> str:
    """The hub id a name stands for: a short name from the table, or a hub id as it is (an
    Ollama-style `:latest` tag dropped). Anything else is a ValueError naming the short names."""
    name = name.strip()
    if name.lower() in SHORT_NAMES:
        return SHORT_NAMES[name.lower()]
    if name.endswith(":latest"):
        name = name[: -len(":latest")]
    if name.count("/") == 1 and all(name.split("/")) and ":" not in name:
        return name
    raise ValueError(f"unknown model name '{name}': use a Hugging Face id (Org/Name) or one of "
                     f"{', '.join(SHORT_NAMES)}")


def short_name(hub: str) -> str | None:
    return next((k.short for k in KNOWN if k.hub_id == hub), None)


def preset_of(name: str) -> str | None:
    """The synth preset of a known model (for sizing without its files), or None."""
    hub = SHORT_NAMES.get(name.lower(), name)
    return next((k.preset for k in KNOWN if k.hub_id == hub), None)


@dataclass(frozen=True)
class LocalModel:
    name: str  # the hub id
    path: Path  # the snapshot folder a server or `--model` loads
    commit: str
    files_bytes: int  # the hub's files, as the Hugging Face cache holds them (every revision)
    quantized: dict[str, Path]  # format (int8, int4) -> qvl's kept copy of it
    stored: str  # the checkpoint's own format: bf16, or a pre-quantised int8/int4
    last_used: float | None  # when a start last used a kept copy (Unix time), None: no record
    modified: float  # when the snapshot was last written

    @property
    def short(self) -> str | None:
        return short_name(self.name)

    @property
    def formats(self) -> list[str]:
        return [self.stored] + sorted(set(self.quantized) - {self.stored})

    @property
    def size(self) -> int:
        return self.files_bytes + sum(_folder_bytes(p) for p in self.quantized.values())

    def to_dict(self) -> dict:
        return {"name": self.name, "short": self.short, "path": str(self.path), "size": self.size,
                "formats": self.formats, "last_used": self.last_used, "modified": self.modified}


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _quantized_copies(commit: str) -> dict[str, Path]:
    """qvl's complete quantised copies of a snapshot (weights.quantized_cache_dir names them
    `<snapshot folder>-<format>-<key>`), newest last."""
    from qvl.paths import cache_root

    root = cache_root() / "quantized"
    found = sorted(root.glob(f"{commit}-*"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    return {p.name[len(commit) + 1:].rsplit("-", 1)[0]: p for p in found
            if any((p / n).exists() for n in ("model.safetensors", "model.safetensors.index.json"))}


def _stored_format(snapshot: Path) -> str:
    from qvl.weights import CheckpointError, checkpoint_quantization

    try:
        spec = checkpoint_quantization(snapshot)
    except (CheckpointError, OSError, ValueError):
        spec = None
    if spec is not None:
        return spec.weights
    config = json.loads((snapshot / "config.json").read_text())
    dtype = config.get("torch_dtype") or config.get("dtype") or config.get("text_config", {}).get("dtype")
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, "bf16")


def _snapshot(repo) -> object | None:
    """The revision `main` points at, else the newest one."""
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified)
    return next((r for r in revisions if "main" in r.refs), revisions[-1] if revisions else None)


def _is_qvl_model(snapshot: Path) -> bool:
    try:
        return json.loads((snapshot / "config.json").read_text()).get("model_type") in SUPPORTED_MODEL_TYPES
    except (OSError, ValueError):
        return False


def _cached_repos() -> list:
    from huggingface_hub import CacheNotFound, constants, scan_cache_dir

    try:
        return [r for r in scan_cache_dir(constants.HF_HUB_CACHE).repos if r.repo_type == "model"]
    except CacheNotFound:
        return []


def local_models() -> list[LocalModel]:
    """The Qwen3-VL / Qwen3.5 models in the Hugging Face cache ($HF_HOME, $HF_HUB_CACHE), by name."""
    out = []
    for repo in _cached_repos():
        rev = _snapshot(repo)
        if rev is None or not _is_qvl_model(rev.snapshot_path):
            continue
        copies = _quantized_copies(rev.commit_hash)
        used = [(p / ".used").stat().st_mtime for p in copies.values() if (p / ".used").exists()]
        out.append(LocalModel(repo.repo_id, rev.snapshot_path, rev.commit_hash, repo.size_on_disk, copies,
                              _stored_format(rev.snapshot_path), max(used, default=None), rev.last_modified))
    return sorted(out, key=lambda m: m.name.lower())


def find_local(name: str) -> LocalModel | None:
    wanted = hub_id(name)
    return next((m for m in local_models() if m.name == wanted), None)


def remove(name: str) -> int:
    """Delete a model from the Hugging Face cache (every revision) and qvl's quantised copies
    of it; returns the bytes freed. A model not in the cache is a LookupError."""
    from huggingface_hub import constants, scan_cache_dir

    wanted = hub_id(name)
    repo = next((r for r in _cached_repos() if r.repo_id == wanted), None)
    if repo is None:
        raise LookupError(f"model '{name}' is not in the Hugging Face cache")
    freed = repo.size_on_disk
    for rev in repo.revisions:
        for copy in _quantized_copies(rev.commit_hash).values():
            freed += _folder_bytes(copy)
            shutil.rmtree(copy, ignore_errors=True)
    scan_cache_dir(constants.HF_HUB_CACHE).delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
    return freed
