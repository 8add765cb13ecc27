"""Importing qvl puts torch's large tensors on transparent huge pages (qvl/__init__.py), and the
environment can say no."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qvl.runtime import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

FAULTS = """
import qvl, resource, torch
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""


def _faults(env: dict) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_large_tensor_faults_in_huge_pages_unless_the_environment_says_no():
    assert _faults({"THP_MEM_ALLOC_ENABLE": None}) < 2000  # 4 KB pages: 16,384 faults for 64 MB
    assert _faults({"THP_MEM_ALLOC_ENABLE": "0"}) > 16000
    assert huge_pages().startswith("tensors of 2 MB")
