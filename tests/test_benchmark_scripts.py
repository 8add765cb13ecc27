"""The benchmark scripts that docs/performance.md gives as commands import and parse --help."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "common.py")


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_starts(script):
    """A script whose imports broke (a helper moved between modules) fails here, not in a timing run."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
