"""Shared fixtures: tiny random checkpoints written by qvl itself (offline)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

from qvl import paths

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
KERNELS = paths.cache_root() / "native"  # qvl's own kernel builds, keyed by sources, tier, compiler and CPU
os.environ["QVL_CACHE_DIR"] = tempfile.mkdtemp(prefix="qvl-test-cache-")  # quantised weights kept here
atexit.register(shutil.rmtree, os.environ["QVL_CACHE_DIR"], ignore_errors=True)  # up to 0.4 GB per run
paths.cache_root.cache_clear()
KERNELS.mkdir(exist_ok=True)
os.symlink(KERNELS, paths.cache_root() / "native")  # built once, not in every run
torch.set_num_threads(min(2, os.cpu_count() or 1))

# An untied, differently shaped variant for parity tests, laid out like 8B and 32B: an untied
# head and a deeper vision tower with three DeepStack layers not at its start.
UNTIED_CHANGES = {
    "tie_word_embeddings": False,
    "text_config": {"num_hidden_layers": 3},
    "vision_config": {"deepstack_visual_indexes": [1, 2, 4], "depth": 6},
}


def hold_tier(monkeypatch, tier) -> None:
    """Run the rest of the test on `tier` (a qvl.kernels.build.Tier this CPU runs): QVL_ISA set
    and the tier's own kernel build chosen (the compute dtype follows it)."""
    from qvl.kernels import build
    from qvl.kernels import library as library_module
    from qvl.kernels.library import Library

    monkeypatch.setenv("QVL_ISA", tier.name)
    monkeypatch.setattr(library_module, "_chosen", [Library(tier, build.load(tier, paths.cache_root() / "native"))])


_EXIT_STATUS = 0


def pytest_sessionfinish(session, exitstatus):
    global _EXIT_STATUS
    _EXIT_STATUS = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """With Ray loaded in this process (the Ray tests start a local instance and shut it down), end
    the process here, after pytest's own reporting and with its exit status: Ray's native threads
    can crash while Python tears the interpreter down (seen once: a segfault in Ray's metrics code
    after every test had passed, exit code 139 for a passing run). Everything written so far is
    flushed first, the summary line ("N passed in ...") in pytest's terminal writer included: _exit
    drops what still sits in a buffer."""
    if "ray" in sys.modules:
        shutil.rmtree(os.environ["QVL_CACHE_DIR"], ignore_errors=True)  # the atexit cleanup, which _exit skips
        if config.pluginmanager.has_plugin("terminalreporter"):  # absent with -p no:terminal
            config.get_terminal_writer().flush()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            stream.flush()
        os._exit(_EXIT_STATUS)


@pytest.fixture(autouse=True)
def seeded_torch():
    """Every test draws the same random tensors on every run, so tolerances cannot turn flaky."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a tiny tied-embedding checkpoint in the official layout."""
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_untied_checkpoint(tmp_path_factory):
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_untied"), "tiny", seed=1, changes=UNTIED_CHANGES)


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    """A tiny mixture-of-experts checkpoint (Qwen3VLMoe layout: 16 experts, 4 per token)."""
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_moe"), "tiny-moe", seed=2)


@pytest.fixture(scope="session")
def tiny35_checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint (hybrid: three Gated DeltaNet layers, then gated attention)."""
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny35"), "qwen3.5-tiny", seed=3)


@pytest.fixture(scope="session")
def tiny_embedding_checkpoint(tmp_path_factory):
    """A tiny Qwen3-VL-Embedding checkpoint (its sentence-transformers files say so)."""
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_embedding"), "embedding-tiny", seed=4)


@pytest.fixture(scope="session")
def tiny_reranker_checkpoint(tmp_path_factory):
    """A tiny Qwen3-VL-Reranker checkpoint."""
    from qvl.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_reranker"), "reranker-tiny", seed=5)


@pytest.fixture(scope="session")
def tiny_embedder(tiny_embedding_checkpoint):
    """A float32 engine on the tiny embedding checkpoint (shared: do not mutate)."""
    from tests.test_retrieval import fp32_engine

    return fp32_engine(tiny_embedding_checkpoint)


@pytest.fixture(scope="session")
def tiny_reranker(tiny_reranker_checkpoint):
    from tests.test_retrieval import fp32_engine

    return fp32_engine(tiny_reranker_checkpoint)


@pytest.fixture(scope="session")
def tiny35_engine(tiny35_checkpoint):
    """The engine a user gets on the tiny Qwen3.5 checkpoint (every default; shared: do not mutate)."""
    from qvl.engine import Engine, EngineOptions

    return Engine.load(EngineOptions(model=str(tiny35_checkpoint), threads=2))


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    """The engine a user gets on the tiny checkpoint: every default (int8 weights, the CPU's compute
    dtype, native kernels, int8 activations) on 2 threads (shared: do not mutate)."""
    from qvl.engine import Engine, EngineOptions

    return Engine.load(EngineOptions(model=str(tiny_checkpoint), threads=2))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    from qvl.processing.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """tokenizer.json, tokenizer_config.json, vocab.json and merges.txt built offline (read-only)."""
    from qvl.processing.tokenizer import write_tokenizer_files

    path = tmp_path_factory.mktemp("qwen_tokenizer")
    write_tokenizer_files(path)
    return path
