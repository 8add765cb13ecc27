"""`qvl info --model`: the memory each weight format needs, checked against what qvl writes."""

from __future__ import annotations

import json

from qvl.cli import main
from qvl.config import ModelConfig
from qvl.sizing import footprint
from qvl.synth import preset_config


def test_bf16_footprint_is_the_checkpoint_size(tiny_untied_checkpoint, tiny_checkpoint):
    for path in (tiny_checkpoint, tiny_untied_checkpoint):  # tied and untied heads
        cfg = ModelConfig.from_file(path / "config.json")
        size = (path / "model.safetensors").stat().st_size
        assert abs(footprint(cfg, "bf16").total_bytes - size) / size < 0.01


def test_int8_and_int4_footprints_match_quantised_files(tiny_untied_checkpoint, tmp_path):
    cfg = ModelConfig.from_file(tiny_untied_checkpoint / "config.json")
    for fmt in ("int8", "int4"):
        out = tmp_path / fmt
        assert main(["quantize", str(tiny_untied_checkpoint), str(out), "--weights", fmt]) == 0
        size = (out / "model.safetensors").stat().st_size
        assert abs(footprint(cfg, fmt).total_bytes - size) / size < 0.05, fmt


def test_published_sizes_and_info(capsys, tiny_checkpoint):
    counts = {"8b": 8.767e9, "32b": 33.36e9}  # parameters of the published configs (../shared/NOTES.md)
    for size, params in counts.items():
        bf16 = footprint(ModelConfig.from_dict(preset_config(size)), "bf16").total_bytes
        assert abs(bf16 / 2 - params) / params < 0.002
    assert main(["info", "--model", str(tiny_checkpoint), "--json"]) == 0
    needs = json.loads(capsys.readouterr().out)["model"]
    assert needs["read_gb_per_s"] > 0 and set(needs["formats"]) == {"bf16", "int8", "int4"}
    assert needs["formats"]["int4"]["total_gb"] < needs["formats"]["int8"]["total_gb"] < needs["formats"]["bf16"]["total_gb"]
    assert main(["info", "--model", "Qwen/Qwen3-VL-8B-Instruct"]) == 0  # known: no download
    assert "int4" in capsys.readouterr().out
