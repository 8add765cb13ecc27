"""`qvl batch --ray` on a local Ray instance gives the same rows as the local path, and carries a --json-schema."""

from __future__ import annotations

import json

import pytest

from qvl.cli import main
from tests.test_batch_cli import qvl_batch, read_rows, write_images
from tests.test_cli_structured import SCHEMA, Answer

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'qvl[ray]'")
pytestmark = pytest.mark.slow  # a local Ray instance and its workers

ARGS = ("--task", "ocr", "--max-new-tokens", "8", "--batch-size", "2")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def without_timings(rows: list[dict]) -> dict[str, dict]:
    return {row["id"]: {k: v for k, v in row.items() if k != "timings"} for row in rows}


def test_ray_rows_match_local_rows_and_resume(tiny_checkpoint, tmp_path, local_ray):
    folder = tmp_path / "images"
    ids = write_images(folder, 5, broken=True)
    local_out, ray_out = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    local = qvl_batch(tiny_checkpoint, folder, "--out", local_out, *ARGS)
    assert local.returncode == 1, local.stderr

    ray_out.write_text("".join(line + "\n" for line in local_out.read_text().splitlines()[:2]))  # a resumed run
    argv = ["batch", str(folder), "--out", str(ray_out), *ARGS, "--model", str(tiny_checkpoint), "--dtype", "fp32",
            "--ray", "--ray-actors", "1"]
    assert main(argv) == 1

    ray_rows = read_rows(ray_out)
    assert sorted(r["id"] for r in ray_rows) == ids
    assert without_timings(ray_rows) == without_timings(read_rows(local_out))


def test_ray_actors_get_the_json_schema(tiny_checkpoint, tmp_path, local_ray):
    """The constraint travels in the WorkSpec (the schema file is read on the driver only)."""
    folder = tmp_path / "images"
    ids = write_images(folder, 3)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "ray.jsonl"
    argv = ["batch", str(folder), "--out", str(out), "--prompt", "Describe it as JSON.", "--json-schema", str(schema),
            "--max-new-tokens", "200", "--temperature", "1", "--seed", "0", "--batch-size", "2",
            "--model", str(tiny_checkpoint), "--dtype", "fp32", "--ray", "--ray-actors", "1"]
    assert main(argv) == 0
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ids
    for row in rows:
        Answer.model_validate(row["json"])
        assert row["json"] == json.loads(row["text"])
