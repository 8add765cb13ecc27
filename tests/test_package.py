"""qvl installs like any other package: `python -m build` makes an sdist and a wheel that carry
the C sources, chat templates and the web page; the wheel pip-installed into a fresh venv runs
`qvl --version`, `qvl info` (compiling the kernels from site-packages, which stays untouched and
read-only) and `qvl ask` on a synthetic checkpoint, from a folder that is not the checkout; so
does qvl installed from the sdist."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import qvl
from qvl.cli import main

ROOT = Path(qvl.__file__).parents[2]
PACKAGE = Path(qvl.__file__).parent


def run(*args, cwd: Path, env: dict | None = None, timeout: int = 900) -> str:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}: {out.stderr[-3000:]}"
    return out.stdout


def clean_env(tmp: Path) -> dict:
    """The environment of a user who never saw the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "QVL_", "VIRTUAL_ENV"))}
    return {**env, "QVL_CACHE_DIR": str(tmp / "cache"), "HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1"}


def shipped(names: list[str], prefix: str) -> set[str]:
    """The package's own data files (sources, templates, web page) as `names` lists them."""
    return {n.removeprefix(prefix) for n in names if n.startswith(prefix)
            and n.rsplit(".", 1)[-1] in ("c", "h", "jinja", "html", "js", "css")}


def files_of(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def writable(folder: Path, on: bool) -> None:
    for p in [folder, *folder.rglob("*")]:
        mode = p.stat().st_mode
        p.chmod(mode | stat.S_IWUSR if on else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_version_is_written_in_one_place(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qvl.__version__"}
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"qvl {qvl.__version__}"


@pytest.mark.slow
def test_wheel_and_sdist_install_and_run_from_site_packages(tmp_path):
    source = tmp_path / "checkout"  # a copy: building writes egg-info and build/ beside the sources
    skipped = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", ".pytest_cache",
                                     ".hypothesis")
    # ./run.sh's own checkpoints/ folder stays out; the package's demo checkpoint goes in
    shutil.copytree(ROOT, source, ignore=lambda folder, names: skipped(folder, names) |
                    ({"checkpoints"} if Path(folder) == ROOT else set()))
    run(sys.executable, "-m", "venv", tmp_path / "builder", cwd=tmp_path)
    run(tmp_path / "builder/bin/pip", "install", "--quiet", "build", cwd=tmp_path)
    run(tmp_path / "builder/bin/python", "-m", "build", "--outdir", tmp_path / "dist", source, cwd=tmp_path)
    [wheel], [sdist] = (tmp_path / "dist").glob("*.whl"), (tmp_path / "dist").glob("*.tar.gz")
    ours = shipped([str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*")], "qvl/")
    assert any(n.startswith("csrc/") and n.endswith(".c") for n in ours)
    assert shipped(zipfile.ZipFile(wheel).namelist(), "qvl/") == ours
    assert shipped(tarfile.open(sdist).getnames(), f"{sdist.name.removesuffix('.tar.gz')}/src/qvl/") == ours

    venv, home = tmp_path / "venv", tmp_path / "elsewhere"
    home.mkdir()
    env = clean_env(tmp_path)
    run(sys.executable, "-m", "venv", venv, cwd=home)
    run(venv / "bin/pip", "install", "--quiet", wheel, cwd=home, env=env)
    site = Path(run(venv / "bin/python", "-c", "import qvl; print(qvl.__file__)", cwd=home, env=env).strip()).parent
    assert site.is_relative_to(venv) and (site / "csrc").is_dir()
    assert run(venv / "bin/qvl", "--version", cwd=home, env=env).strip() == f"qvl {qvl.__version__}"

    before = files_of(site)
    writable(site, False)
    info = json.loads(run(venv / "bin/qvl", "info", "--json", cwd=home, env=env))
    assert "built with" in info["kernels"] and list((tmp_path / "cache/native").glob("*.so"))
    run(venv / "bin/qvl", "synth", home / "ckpt", cwd=home, env=env)
    answer = json.loads(run(venv / "bin/qvl", "ask", "--model", home / "ckpt", "Hi", "--max-new-tokens", "2",
                            "--json", cwd=home, env=env))
    assert answer["usage"]["completion_tokens"] == 2
    demo = Path(run(venv / "bin/python", "-m", "qvl.demo", "path", cwd=home, env=env).strip())
    assert (demo / "tokenizer.json").is_file() and not demo.is_relative_to(site)  # the shipped demo model, ready
    assert files_of(site) == before  # the kernels, quantised weights and demo folder went to the cache

    writable(site, True)
    run(venv / "bin/pip", "uninstall", "--yes", "--quiet", "qvl", cwd=home, env=env)
    run(venv / "bin/pip", "install", "--quiet", "--no-deps", sdist, cwd=home, env=env)  # built from the sources
    assert run(venv / "bin/qvl", "--version", cwd=home, env=env).strip() == f"qvl {qvl.__version__}"
    answer = json.loads(run(venv / "bin/qvl", "ask", "--model", home / "ckpt", "Hi", "--max-new-tokens", "2",
                            "--json", cwd=home, env=env))
    assert answer["usage"]["completion_tokens"] == 2
