"""`qvl batch` inputs: folder, glob and JSONL become items with stable ids."""

from __future__ import annotations

import json

import pytest

from qvl.batch.inputs import Item, UsageError, read_items


@pytest.fixture
def folder(tmp_path):
    for name in ["b.png", "a.JPG", "sub/c.webp", "sub/deeper/d.jpeg", "notes.txt", "sub/readme.md"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    return tmp_path


def test_folder_is_recursive_sorted_and_ids_are_relative_paths(folder):
    items = read_items(str(folder))
    assert [i.id for i in items] == ["a.JPG", "b.png", "sub/c.webp", "sub/deeper/d.jpeg"]
    assert items[2] == Item("sub/c.webp", str(folder / "sub" / "c.webp"), None)


def test_ids_do_not_depend_on_how_input_is_spelled(folder, monkeypatch):
    monkeypatch.chdir(folder.parent)
    relative = read_items(folder.name + "/")
    assert [i.id for i in relative] == [i.id for i in read_items(str(folder))]


def test_glob_ids_are_relative_to_its_fixed_folders(folder):
    items = read_items(str(folder / "sub" / "**" / "*.*"))
    assert [i.id for i in items] == ["c.webp", "deeper/d.jpeg"]  # readme.md is not an image
    assert [i.id for i in read_items(str(folder / "*.png"))] == ["b.png"]


def test_jsonl_rows_with_ids_prompts_and_relative_paths(tmp_path):
    rows = [{"id": 7, "image": "x.png", "prompt": "Read it."}, {"image": "/abs/y.png"}, {}]
    path = tmp_path / "job.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    assert read_items(str(path)) == [Item("7", str(tmp_path / "x.png"), "Read it."),
                                     Item("/abs/y.png", "/abs/y.png", None)]


@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "image": "1.png"}', '{"id": "a", "image": "2.png"}'], "duplicate ids in .*'a'"),
    (['{"image": "1.png"}', "{oops"], r"job.jsonl:2: not valid JSON"),
    (['{"id": "a"}'], r"job.jsonl:1: a row needs an \"image\" \(an image or a PDF\) or a \"video\""),
    (['{"image": "1.png", "prompt": 3}'], r"\"prompt\" must be a string"),
])
def test_bad_jsonl_fails_at_start_naming_the_problem(tmp_path, lines, message):
    path = tmp_path / "job.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError, match=message):
        read_items(str(path))


def test_missing_or_empty_input(tmp_path):
    with pytest.raises(UsageError, match="INPUT not found"):
        read_items(str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="no images, videos or PDFs"):
        read_items(str(tmp_path))
