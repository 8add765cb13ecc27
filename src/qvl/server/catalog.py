"""What the server says about its models: OpenAI's GET /v1/models and Ollama's GET /api/tags
(every model it serves, loaded or not, with its size on disk), GET /api/ps (the loaded ones,
with the memory each holds and when it will be unloaded) and POST /api/show (one model's
facts, from the loaded model: it loads it as a request would)."""

from __future__ import annotations

import functools
import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from qvl import __version__
from qvl.config import ModelConfig
from qvl.engine import Engine
from qvl.server.registry import Model
from qvl.server.schemas import ModelCard, ModelList, _Strict
from qvl.server.state import ServerState
from qvl.server.submit import read_body

ARCHITECTURES = {"qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe", "qwen3_5": "qwen35",
                 "qwen3_5_moe": "qwen35moe"}  # model types as Ollama (llama.cpp's GGUF) spells them
FOREVER = "9999-12-31T23:59:59Z"  # the expiry of a model kept loaded


class ShowBody(_Strict):
    model: str | None = None
    name: str | None = None  # what older clients send
    verbose: bool = False  # accepted; the answer is the same


class Catalog:
    def __init__(self, state: ServerState):
        self.state = state

    async def models(self) -> dict:
        self.state.ready()
        cards = [ModelCard(id=m.name, created=self.state.started) for m in self.state.models.models]
        return ModelList(data=cards).model_dump()

    async def tags(self) -> dict:
        self.state.ready()
        return {"models": await run_in_threadpool(lambda: [entry(m) for m in self.state.models.models])}

    async def ps(self) -> dict:
        self.state.ready()
        entries = await run_in_threadpool(lambda: [loaded_entry(m) for m in self.state.models.loaded()])
        return {"models": [e for e in entries if e]}

    async def show(self, http: HTTPRequest) -> dict:
        body = ShowBody.model_validate_json(await read_body(http, self.state.settings.max_body_bytes) or b"{}")
        lease = await self.state.acquire(body.model or body.name)
        try:
            return show(lease.engine)
        finally:
            lease.release()


def entry(model: Model) -> dict:
    """A model as /api/tags lists it: its files on disk and the weight format it runs in."""
    engine = model.engine
    path, weights = (engine.path, engine.weights) if engine is not None else (model.path, model.weights)
    name = ollama_name(model.name)
    return {"name": name, "model": name, "modified_at": modified(path), "size": disk_bytes(path),
            "digest": digest(path, weights), "details": details(path, weights)}


def loaded_entry(model: Model) -> dict:
    """A loaded model as /api/ps lists it: what it holds in memory, and when it goes."""
    engine = model.engine
    if engine is None:  # unloaded meanwhile
        return {}
    return {**entry(model), "size": model.held_bytes(), "size_vram": 0, "expires_at": expires_at(model),
            "context_length": engine.options.max_context}


def show(engine: Engine) -> dict:
    d = engine.defaults
    parameters = "\n".join(f"{k} {v}" for k, v in (("temperature", d.temperature), ("top_k", d.top_k),
                                                     ("top_p", d.top_p), ("repeat_penalty", d.repetition_penalty)))
    text, arch = engine.cfg.text, ARCHITECTURES[engine.cfg.model_type]
    capabilities = (["completion", "vision", "tools"] + (["thinking"] if engine.thinks(True) else [])
                    if engine.task == "generate" else ["embedding", "vision"] if engine.task == "embed" else ["vision"])
    return {"license": "", "modelfile": f"# served by qvl {__version__}\nFROM {engine.path}\n",
            "parameters": parameters, "template": engine.template, "details": details(engine.path, engine.weights),
            "model_info": {"general.architecture": arch, "general.basename": engine.model_name,
                           f"{arch}.context_length": engine.options.max_context,
                           f"{arch}.embedding_length": text.hidden_size,
                           f"{arch}.block_count": text.num_hidden_layers},
            "capabilities": capabilities, "modified_at": modified(engine.path)}


def ollama_name(name: str) -> str:
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"


def expires_at(model: Model) -> str:
    """When the model will be unloaded for being idle: its expiry once nobody holds it (while
    held: its keep-alive from now)."""
    if model.keep_alive_s is None:
        return FOREVER
    left = model.expires - time.monotonic() if model.expires is not None else model.keep_alive_s
    return iso(time.time() + max(0.0, left))


def iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")


def disk_bytes(path: Path | None) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path is not None else 0


def modified(path: Path | None) -> str:
    if path is None:
        return iso(0)
    files = list(path.glob("*.safetensors")) or [path]
    return iso(max(f.stat().st_mtime for f in files))


def digest(path: Path | None, weights: str) -> str:
    """Stands for the checkpoint and its weight format (the same in /api/tags and /api/ps)."""
    return hashlib.sha256(f"{path.resolve() if path else ''}|{weights}".encode()).hexdigest()


def details(path: Path | None, weights: str) -> dict:
    facts = checkpoint_facts(path, (path / "config.json").stat().st_mtime) \
        if path is not None and (path / "config.json").is_file() else None
    arch, params = facts or ("", 0)
    size = "" if not params else f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    return {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch] if arch else [],
            "parameter_size": size, "quantization_level": weights.upper()}


@functools.lru_cache(maxsize=64)
def checkpoint_facts(path: Path, _config_mtime: float) -> tuple[str, int] | None:
    """(architecture, parameter count) from a checkpoint's config.json (None when it cannot
    be read); counted on the meta device, nothing allocated."""
    from qvl.model.qwen3_vl import Qwen3VL

    try:
        cfg = ModelConfig.from_file(path / "config.json")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    with torch.device("meta"):
        model = Qwen3VL(cfg)
    return ARCHITECTURES[cfg.model_type], sum(p.numel() for p in model.parameters())
