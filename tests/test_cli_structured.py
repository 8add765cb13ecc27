"""`qvl ask`, `qvl chat` and `qvl batch` with --json-schema, --grammar and --regex on the tiny
random checkpoint: whatever random weights would say, a constrained answer parses and validates
(the schema is bounded, so it always ends); a bad constraint is a one-line usage error before
any model loads."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from qvl.cli import main
from tests.test_batch_cli import read_rows, write_images

# Bounded everywhere (an enum, an integer range, a short string, a short array): an answer under
# it ends within ~100 tokens, so --max-new-tokens 200 never cuts one.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "label": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["colour", "count", "label", "tags"],
    "additionalProperties": False,
}


class Answer(BaseModel):
    """SCHEMA as a pydantic model, to validate answers with."""

    model_config = ConfigDict(extra="forbid", strict=True)
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)
    label: str = Field(max_length=8)
    tags: list[Literal["a", "b"]] = Field(max_length=2)


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def test_ask_json_schema_answer_validates(tiny_checkpoint, schema_file, capsys):
    assert main(["ask", "-m", str(tiny_checkpoint), "--json-schema", str(schema_file), "--json", "--temperature", "1",
                 "--seed", "0", "--max-new-tokens", "200", "Describe something."]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop"
    Answer.model_validate(out["json"])
    assert out["json"] == json.loads(out["text"])


def test_ask_grammar_and_regex(tiny_checkpoint, tmp_path, capsys):
    grammar = tmp_path / "yes_no.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert main(["ask", "-m", str(tiny_checkpoint), "--grammar", str(grammar), "--temperature", "1", "Yes?"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    pattern = r"[0-9]{3}-[a-z]{2}"
    assert main(["ask", "-m", str(tiny_checkpoint), "--regex", pattern, "--temperature", "1", "A code?"]) == 0
    assert re.fullmatch(pattern, capsys.readouterr().out.strip())


def test_chat_turns_follow_the_constraint(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    grammar = tmp_path / "yes_no.lark"
    grammar.write_text('start: "yes" | "no"\n')
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("Is it red?\nAnd blue?\n/quit\n"))
    assert main(["chat", "-m", str(tiny_checkpoint), "--grammar", str(grammar), "--temperature", "1"]) == 0
    answers = [a.strip() for a in capsys.readouterr().out.split(">")[1:-1]]  # "> yes> no> ": prompt, answer, ...
    assert len(answers) == 2 and set(answers) <= {"yes", "no"}, answers


@pytest.mark.parametrize("case", ["missing", "not_json", "not_an_object", "cannot_enforce", "bad_regex",
                                  "bad_grammar", "ignore_eos"])
def test_bad_constraint_is_a_one_line_usage_error(tmp_path, capsys, case):
    files = {"not_json.json": "{nope", "array.json": "[1, 2]", "bad_type.json": '{"type": "strin"}',
             "bad.lark": "start: foo\n", "ok.json": "{}"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args, says = {
        "missing": (["--json-schema", tmp_path / "nope.json"], "cannot read it"),
        "not_json": (["--json-schema", tmp_path / "not_json.json"], "not JSON"),
        "not_an_object": (["--json-schema", tmp_path / "array.json"], "must be a JSON object"),
        "cannot_enforce": (["--json-schema", tmp_path / "bad_type.json"], "cannot enforce this JSON schema"),
        "bad_regex": (["--regex", "(a"], "cannot enforce this regular expression"),
        "bad_grammar": (["--grammar", tmp_path / "bad.lark"], 'unknown name: "foo"'),
        "ignore_eos": (["--json-schema", tmp_path / "ok.json", "--ignore-eos"], "cannot be combined"),
    }[case]
    # a model that does not exist: the constraint is refused before any model loads
    assert main(["ask", "-m", str(tmp_path / "no-model"), *map(str, args), "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qvl ask: error: --") and says in lines[0], lines


def test_constraint_flags_are_exclusive(schema_file):
    with pytest.raises(SystemExit) as exit_:
        main(["ask", "--json-schema", str(schema_file), "--regex", "a", "hi"])
    assert exit_.value.code == 2


@pytest.mark.slow  # two `qvl batch` runs
def test_batch_json_schema_rows_validate_and_cut_answers_are_errors(tiny_checkpoint, schema_file, tmp_path, capsys):
    folder = tmp_path / "images"
    ids = write_images(folder, 4)
    out = tmp_path / "results.jsonl"
    common = ["batch", str(folder), "--out", str(out), "--prompt", "Describe it as JSON.", "--json-schema",
              str(schema_file), "--model", str(tiny_checkpoint), "--threads", "1", "--dtype", "fp32",
              "--temperature", "1", "--seed", "0"]

    assert main([*common, "--max-new-tokens", "6"]) == 1  # too few tokens for any answer under SCHEMA
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ids
    for row in rows:
        assert "json" not in row and row["finish_reason"] == "length" and row["text"]
        assert row["error"] == ("the answer reached the token limit (6 tokens) before its JSON was complete: "
                                "raise --max-new-tokens")

    assert main([*common, "--max-new-tokens", "200", "--retry-errors"]) == 0
    assert "removed 4 error row(s)" in capsys.readouterr().err
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ids
    for row in rows:
        assert "error" not in row and row["finish_reason"] == "stop"
        Answer.model_validate(row["json"])
        assert row["json"] == json.loads(row["text"])


def test_batch_bad_schema_is_a_usage_error_before_any_output(tmp_path, capsys):
    folder = tmp_path / "images"
    write_images(folder, 1)
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    out = tmp_path / "results.jsonl"
    assert main(["batch", str(folder), "--out", str(out), "--prompt", "p", "--json-schema", str(tmp_path / "bad.json"),
                 "--model", str(tmp_path / "no-model")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qvl batch: error: --json-schema"), lines
    assert not out.exists()
