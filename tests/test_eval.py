"""`qvl eval` on the tiny checkpoint: the scores are right for known answers (a set labelled with
the model's own answers from `qvl batch` scores 100%, a corrupted label costs exactly its item),
several configurations side by side, and bad labels reported by line before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qvl.cli import main
from qvl.demo.data import write_set
from qvl.eval.metrics import cer, edit_distance, matched, point_hit, score
from qvl.grounding import Box, Point

ENGINE = ["--threads", "1", "--dtype", "fp32", "--max-new-tokens", "8"]


def test_metrics_on_known_answers():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert cer(" 12.50 ", "12.50") == 0 and cer("12.5", "12.50") == 0.2
    a, b = Box(0, 0, 100, 100), Box(50, 0, 150, 100)  # half of each overlaps: IoU 1/3
    assert score('[{"bbox_2d": [0, 0, 100, 100], "label": "x"}]', '[{"bbox_2d": [50, 0, 150, 100]}]',
                 "boxes") == {"exact": False, "iou": pytest.approx(1 / 3)}
    from qvl.eval.metrics import iou

    assert matched([a, b], [b], iou) == pytest.approx(0.5)  # the extra box costs a whole box
    assert matched([], [], iou) == 1.0 and matched([a], [], iou) == 0.0
    assert matched([Point(10, 10)], [Point(40, 50)], point_hit) == 1.0  # 50 units apart: a hit
    assert matched([Point(10, 10)], [Point(60, 60)], point_hit) == 0.0
    assert score(None, "abc", "text") == {"exact": False, "cer": 1.0}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, tiny_checkpoint):
    """A drawn set (reading and questions) labelled with the tiny model's own greedy answers,
    as `qvl batch` gives them."""
    folder = tmp_path_factory.mktemp("eval-set")
    write_set(folder, seed=5, count=4, task="read")
    rows = [json.loads(line) for line in (folder / "labels.jsonl").read_text().splitlines()]
    batch_in = folder / "batch.jsonl"
    batch_in.write_text("".join(json.dumps({"id": r["id"], "image": r["image"], "prompt": r["question"]}) + "\n"
                                for r in rows))
    out = folder / "answers.jsonl"
    assert main(["batch", str(batch_in), "--out", str(out), "--model", str(tiny_checkpoint),
                 "--temperature", "0", "--weights", "int8", *ENGINE]) == 0
    answers = {row["id"]: row["text"] for row in map(json.loads, out.read_text().splitlines())}
    for row in rows:
        row["answer"] = answers[row["id"]]
    write_labels(folder / "labels.jsonl", rows)
    return folder, rows


def write_labels(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_own_answers_score_100_and_a_corrupted_label_costs_its_item(labelled, tiny_checkpoint, tmp_path, capsys):
    folder, rows = labelled
    corrupted = [dict(r) for r in rows]
    corrupted[1]["answer"] = corrupted[1]["answer"] + "x"
    corrupted[1]["image"] = str(folder / corrupted[1]["image"])  # an absolute path works too
    labels = write_labels(folder / "corrupted.jsonl", corrupted)
    out = tmp_path / "eval.json"
    assert main(["eval", str(folder), "--model", str(tiny_checkpoint), "--weights", "int8,fp32",
                 "--json", str(out), *ENGINE]) == 0
    printed = capsys.readouterr().out
    assert "| int8 |" in printed and "| fp32 |" in printed and "(4 items)" in printed
    int8, fp32 = json.loads(out.read_text())["configurations"]
    assert int8["summary"]["exact"] == 1.0 and int8["summary"]["text"]["cer"] == 0.0
    assert [item["answer"] for item in int8["items"]] == [r["answer"] for r in rows]
    assert fp32["configuration"]["resolved"]["weights"] == "fp32" and fp32["summary"]["items"] == 4

    assert main(["eval", str(labels), "--model", str(tiny_checkpoint), "--weights", "int8", "--json", str(out),
                 *ENGINE]) == 0
    result = json.loads(out.read_text())["configurations"][0]
    assert result["summary"]["exact"] == 0.75
    wrong = result["items"][1]
    length = len(rows[1]["answer"].strip())
    assert not wrong["exact"] and wrong["cer"] == pytest.approx(1 / max(1, length + 1))
    assert all(item["exact"] for k, item in enumerate(result["items"]) if k != 1)


def test_bad_labels_are_reported_by_line(labelled, tiny_checkpoint, tmp_path, capsys):
    folder, rows = labelled
    good = dict(rows[0], image=str(folder / rows[0]["image"]))
    lines = [json.dumps(good), "{not json", json.dumps({**good, "id": "b"}).replace('"answer"', '"answr"'),
             json.dumps({**good, "id": "c", "kind": "table"}), json.dumps({**good, "id": "d", "image": "gone.png"}),
             json.dumps({**good, "id": "e", "kind": "boxes", "answer": "a cat"}), json.dumps(good),
             json.dumps({**good, "id": "f", "question": ""})]
    labels = tmp_path / "labels.jsonl"
    labels.write_text("\n".join(lines) + "\n")
    assert main(["eval", str(labels), "--model", str(tiny_checkpoint), *ENGINE]) == 2
    err = capsys.readouterr().err
    assert "7 bad label line(s)" in err
    for number, what in ((2, "not valid JSON"), (3, 'needs an "answer"'), (4, "'table'"), (5, "gone.png"),
                         (6, "holds no bbox_2d"), (7, "already used on line 1"), (8, '"question"')):
        assert f"labels.jsonl:{number}: " in err and what in err, (number, err)
    assert main(["eval", str(tmp_path / "nowhere"), "--model", str(tiny_checkpoint)]) == 2
    assert "no labels at" in capsys.readouterr().err


@pytest.mark.slow  # another tier's process: loads the engine again
def test_a_tier_runs_in_its_own_process(labelled, tiny_checkpoint, tmp_path):
    folder, rows = labelled
    out = tmp_path / "eval.json"
    assert main(["eval", str(folder), "--model", str(tiny_checkpoint), "--weights", "int8", "--isa", "portable",
                 "--json", str(out), *ENGINE]) == 0
    result = json.loads(out.read_text())["configurations"][0]
    assert result["configuration"]["resolved"]["tier"] == "portable" and result["summary"]["items"] == 4
