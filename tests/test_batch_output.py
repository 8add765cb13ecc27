"""The results file: whole lines, truncated-last-line repair, done ids, --retry-errors, lock."""

from __future__ import annotations

import json
import os

import pytest

from qvl.batch.inputs import UsageError, read_items
from qvl.batch.output import ResultsFile, repair

GOOD = [{"id": "a", "text": "x"}, {"id": "b", "error": "not an image"}, {"id": "c", "text": "中文\n2"}]


def write_rows(path, rows) -> bytes:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    path.write_bytes(data)
    return data


def test_rows_are_whole_lines_and_done_ids_are_read_back(tmp_path):
    path = tmp_path / "out" / "results.jsonl"
    with ResultsFile(path) as results:
        assert results.done == {} and results.repaired_bytes == 0
        for row in GOOD:
            results.write(row)
    assert [json.loads(line) for line in path.read_text().splitlines()] == GOOD
    with ResultsFile(path) as results:
        assert results.done == {"a": True, "b": False, "c": True}


@pytest.mark.parametrize("cut", [1, 10, "all-but-newline"])
def test_a_truncated_last_line_is_removed_and_good_lines_kept(tmp_path, cut):
    path = tmp_path / "results.jsonl"
    good = write_rows(path, GOOD[:2])
    last = (json.dumps(GOOD[2], ensure_ascii=False) + "\n").encode()
    partial = last[:-1] if cut == "all-but-newline" else last[:cut]
    path.write_bytes(good + partial)
    with ResultsFile(path) as results:
        assert results.repaired_bytes == len(partial)
        assert set(results.done) == {"a", "b"}
        results.write(GOOD[2])
    assert path.read_bytes() == good + last


def test_repair_leaves_a_good_file_alone_and_empties_a_lone_partial_line(tmp_path):
    path = tmp_path / "results.jsonl"
    good = write_rows(path, GOOD)
    assert repair(path) == 0 and path.read_bytes() == good
    path.write_bytes(b'{"id": "a", "te')
    assert repair(path) == 15 and path.read_bytes() == b""


def test_lines_that_are_not_rows_are_kept_and_ignored(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"id": "a", "text": ""}\nnot json\n[1]\n')
    with ResultsFile(path) as results:
        assert results.done == {"a": True} and results.scan.bad_lines == 2
    assert path.read_bytes() == b'{"id": "a", "text": ""}\nnot json\n[1]\n'


def test_drop_errors_keeps_good_lines_byte_for_byte(tmp_path):
    path = tmp_path / "results.jsonl"
    write_rows(path, GOOD)
    with ResultsFile(path) as results:
        assert results.drop_errors() == 1
        assert results.done == {"a": True, "c": True}
        results.write({"id": "b", "text": "now it works"})
    expected = [GOOD[0], GOOD[2], {"id": "b", "text": "now it works"}]
    assert path.read_text().splitlines() == [json.dumps(r, ensure_ascii=False) for r in expected]
    assert not (tmp_path / "results.jsonl.tmp").exists()


def test_a_second_writer_is_refused(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultsFile(path):
        with pytest.raises(UsageError, match="another qvl batch is writing"):
            ResultsFile(path)
    ResultsFile(path).close()  # free again once the first one closed


def test_a_file_name_that_is_not_utf8_is_written_and_resumed(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / os.fsdecode(b"\xff.png")).write_bytes(b"")  # bytes from another locale
    (item,) = read_items(str(folder))
    path = tmp_path / "results.jsonl"
    with ResultsFile(path) as results:
        results.write({"id": item.id, **item.fields(), "error": "not a recognised image format"})
        results.write({"id": "next", "text": "the run goes on"})
    lines = path.read_bytes().decode("utf-8").splitlines()  # strict: every line is UTF-8 JSON
    row = json.loads(lines[0])
    assert row["id"] == item.id and os.fsencode(row["image"]) == os.fsencode(folder) + b"/\xff.png"
    with ResultsFile(path) as results:
        assert results.done == {item.id: False, "next": True}  # resume knows the item
