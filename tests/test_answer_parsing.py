"""Reading what a model wrote: tool calls, grounding JSON and stop strings in time linear in
the text however it arrives (a character at a time or whole), at any nesting depth, and an
answer cut short returned as what it is, never turned into an error."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from qvl.grounding import Box, parse
from qvl.server.settings import ConnectionLimits
from qvl.stream import StopStrings
from qvl.tools import CallArguments, CallStart, TextPiece, ToolCallStream, parse_answer
from tests.test_server_api import make_app, wait_ready
from tests.test_server_hardening import live

SPACE_128 = 56940  # the token of 128 spaces in Qwen's vocabulary
WHITESPACE = (" " * 7 + "\n") * 6250  # 50,000 characters
HEAD = '<tool_call>\n{"name": "f", "arguments": '


def timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - started


def stream(text: str, step: int, whole: bool = False) -> tuple[list, ToolCallStream]:
    """The events of `text` fed `step` characters at a time."""
    parser = ToolCallStream(whole=True) if whole else ToolCallStream()
    events = [e for i in range(0, len(text), step) for e in parser.feed(text[i: i + step])]
    return events + parser.finish(), parser


def streamed_arguments(events: list) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArguments):
            out[e.index] = out.get(e.index, "") + e.text
    return out


# -- tool calls ----------------------------------------------------------------------------------


def blanks(n: int) -> str:
    return ((" " * 7 + "\n") * (n // 8 + 1))[:n]


@pytest.mark.parametrize("template", [
    '{{"s": "{}',  # inside a string, the answer cut there
    '{{"s": 1{}}}',  # between the arguments' tokens
    "{{}}{}",  # after the arguments, before the block's closing brace
], ids=["in a string", "between tokens", "after the arguments"])
@pytest.mark.parametrize("step", [1, 7, None], ids=["1 char", "7 chars", "whole"])
def test_a_call_with_tens_of_thousands_of_blanks_is_read_in_linear_time(template, step):
    """50,000 blanks take about ten times what 5,000 take (a pattern that backtracked over the
    tail took a hundred times: 12 s here, minutes to hours once the string closed after them),
    however busy the machine is."""
    def seconds(n: int) -> float:
        text = HEAD + template.format(blanks(n))
        return min(timed(stream, text, step or len(text))[1] for _ in range(2))

    assert seconds(50_000) < 30 * seconds(5_000) + 0.05
    arguments = template.format(WHITESPACE)
    (events, parser), _ = timed(stream, HEAD + arguments, step or len(HEAD + arguments))
    written = arguments.rstrip() if arguments.startswith("{}") else arguments
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", written)]
    assert streamed_arguments(events) == {0: written}


@pytest.mark.parametrize("step", [1, None])
def test_blanks_then_a_closing_quote_are_read_in_linear_time(step):
    """The review's request: a string of blanks closed by its quote; each token after the
    quote cost a search cubic in the blanks (1,000 of them: seconds per token)."""
    arguments = '{"s": "' + " " * 1000 + '"}'
    text = f"{HEAD}{arguments}}}\n</tool_call>"
    (events, parser), seconds = timed(stream, text, step or len(text))
    assert seconds < 0.5
    assert [c.arguments for c in parser.calls] == [arguments] and streamed_arguments(events) == {0: arguments}


def test_a_head_that_never_comes_is_given_up_after_its_window():
    """Blanks where the call's name should be: the head is looked for in the block's first
    characters only, and the block is given back as text."""
    def text(n: int) -> str:
        return "<tool_call>" + blanks(n) + '{"name": "f", "arguments": {}}</tool_call>'

    assert min(timed(stream, text(50_000), 1)[1] for _ in range(2)) < \
           30 * min(timed(stream, text(5_000), 1)[1] for _ in range(2)) + 0.05
    text = text(50_000)
    events, parser = stream(text, 1)
    assert parser.calls == [] and "".join(e.text for e in events if isinstance(e, TextPiece)) == text


BLOCKS = st.sampled_from([
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"s": "a \\" } ] <tool_call"}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n',
    "<tool_call>not a call</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": ' + '{"a": ' * 150 + "1" + "}" * 150 + "}</tool_call>",
])
TEXT = st.lists(st.sampled_from(["a", " ", "\n", "{", '"', "<", "<tool", "</tool_call", "_call>"]),
                max_size=6).map("".join)
ANSWERS = st.tuples(st.lists(st.one_of(BLOCKS, TEXT), max_size=5),
                    st.sampled_from(["", '<tool_call>\n{"name": "f", "arguments": {"s": "cut', "<tool_ca"]))


@settings(max_examples=150, deadline=None)
@given(ANSWERS, st.integers(1, 9), st.booleans())
def test_streaming_in_any_pieces_reads_what_the_whole_answer_reads(answer, step, whole):
    text = "".join(answer[0]) + answer[1]
    expected_text, expected_calls = parse_answer(text, whole)
    events, parser = stream(text, step, whole)
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == expected_text
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in expected_calls]
    if not whole:
        assert streamed_arguments(events) == {i: c.arguments for i, c in enumerate(parser.calls)}
        assert [e.name for e in events if isinstance(e, CallStart)] == [c.name for c in parser.calls]


@pytest.mark.parametrize("block", [
    '{"name": "f", "arguments": ' + '{"a": ' * 1100 + "1" + "}" * 1100 + "}",  # deeper than json reads
    '{"name": "f", "arguments": {"city": "Os',  # cut
    '{"name": "f", "arguments": {"x": NaN}}',  # not JSON
    '{"name": "f", "arguments": {"x": 1} trailing}',
])
def test_whole_calls_are_only_objects_json_can_carry(block):
    """Ollama's calls carry their arguments as an object: a block whose arguments are none
    (or could not be written back as one) stays text, as the model wrote it."""
    for closing in ("\n</tool_call>", ""):
        text = f"<tool_call>\n{block}{closing}"
        assert parse_answer(text, whole=True) == (text, [])
        assert parse_answer(text)[1][0].arguments  # streaming readers keep the call as written
    _, calls = parse_answer('<tool_call>\n{"name": "f", "arguments": {"x": [1]}}\n</tool_call>', whole=True)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": [1]}')]


# -- grounding, stop strings ---------------------------------------------------------------------


def test_grounding_reads_any_depth():
    deep = '{"a": ' * 1100 + '{"bbox_2d": [1, 2, 3, 4], "label": "cat"}' + "}" * 1100
    assert parse(deep) == ([Box(1, 2, 3, 4, "cat")], [])
    deep_label = '{"bbox_2d": [1, 2, 3, 4], "label": ' + "[" * 3000 + "]" * 3000 + "}"
    assert parse(deep_label) == ([Box(1, 2, 3, 4, "")], [])
    assert parse('{"a": [' * 5000) == ([], [])  # cut deep inside


@pytest.mark.parametrize("text", [
    '{"a": "{\\"b\\": 1, ' * 30_000,  # braces inside strings: each was read to the end again
    '"{"' * 100_000,
    '{"a": [1, ' * 20_000,
])
def test_grounding_reads_each_brace_once(text):
    """Every `{` is tried as an object's start; one reading records every object it opens, so
    none is read twice (these took seconds to tens of seconds, or raised RecursionError)."""
    (found, seconds) = timed(parse, text)
    assert found == ([], []) and seconds < 3


def test_a_long_stop_string_is_followed_in_linear_time():
    """A 200,000-character stop string and an answer that keeps matching its start: each
    character is read once (this took 30 s)."""
    stops = StopStrings(("a" * 200_000 + "b",))

    def run() -> tuple[int, tuple[str, bool]]:
        emitted = sum(len(stops.push("aaaa")[0]) for _ in range(100_000))
        return emitted, stops.push("b")

    (emitted, last), seconds = timed(run)
    assert seconds < 3 and emitted == 200_000 and last == ("", True)


# -- over HTTP -----------------------------------------------------------------------------------


def spaces_call(n: int, stream_: bool) -> dict:
    """A forced call whose string argument must be `n` blanks, the 128-blank token favoured."""
    parameters = {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^ {{{n}}}$"}},
                  "required": ["s"]}
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream_, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required", "parallel_tool_calls": False, "logit_bias": {str(SPACE_128): 100},
            "max_tokens": n // 128 + 30}


# Polls /health from another process, whose clock runs while this one's threads wait for the GIL
# (a regular expression holds it for as long as it runs); prints the slowest answer's seconds.
PROBE = """
import select, sys, time, httpx
slowest = 0.0
while not select.select([sys.stdin], [], [], 0.05)[0]:  # until stdin closes
    started = time.perf_counter()
    assert httpx.get(sys.argv[1] + "/health", timeout=300).status_code == 200
    print("polling", flush=True) if not slowest else None
    slowest = max(slowest, time.perf_counter() - started)
print(slowest)
"""


@pytest.mark.parametrize("stream_", [True, False], ids=["streamed", "whole"])
def test_health_answers_while_a_call_of_blanks_is_read(tiny_engine, stream_):
    """While the model writes 1,280 blanks into a call, other connections are answered (the
    event loop was held for seconds per token after the closing quote)."""
    tiny_engine.grammars.warm_up()  # the tokenizer's index, built once, holds the GIL for seconds
    with live(tiny_engine, ConnectionLimits()) as srv:
        probe = subprocess.Popen([sys.executable, "-c", PROBE, srv.url], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert probe.stdout.readline() == "polling\n"
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=spaces_call(1280, stream_),
                              timeout=300) as r:
                lines = [line for line in r.iter_lines() if line]
            slowest = float(probe.communicate("", timeout=300)[0].split()[-1])
        finally:
            probe.kill()
    assert slowest < 2.0
    if stream_:
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        arguments = "".join(call["function"]["arguments"] for c in chunks for choice in c["choices"]
                            for call in choice["delta"].get("tool_calls") or [])
        assert lines[-1] == "data: [DONE]"
    else:
        arguments = json.loads(lines[0])["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"s": " " * 1280}


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_ollama_call_cut_by_num_predict_is_returned_as_text(tiny_engine):
    """tools and a format, cut inside a call's arguments: the text as written and
    done_reason "length", streamed and not (this was a 400, and a stream that broke off)."""
    with TestClient(make_app(tiny_engine)) as client:
        wait_ready(client)
        for seed in range(20):  # the random model calls the tool for about half the seeds
            body = {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                    "tools": [WEATHER], "format": {"type": "object", "properties": {"answer": {"type": "string"}}},
                    "options": {"num_predict": 18, "seed": seed, "temperature": 1.0}}
            whole = client.post("/api/chat", json=body)
            assert whole.status_code == 200, whole.text
            if whole.json()["message"]["content"].startswith("<tool_call>"):
                break
        else:
            pytest.fail("no seed made the model call the tool")
        message = whole.json()["message"]
        assert whole.json()["done_reason"] == "length" and "tool_calls" not in message
        assert '"arguments": {"city": "' in message["content"]
        with client.stream("POST", "/api/chat", json={**body, "stream": True}) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1]["done"] and lines[-1]["done_reason"] == "length"
        assert "".join(line["message"]["content"] for line in lines) == message["content"]
        assert not any(line["message"].get("tool_calls") for line in lines)


@pytest.mark.slow
def test_an_answer_of_1100_nested_levels_is_answered_and_repeated(tiny_engine):
    """A regex forces 1,100 nested arrays into an object: grounding reads it (it raised
    RecursionError: a 500), and the exact repeat, answered from the cache, succeeds too,
    whole and streamed."""
    depth = 1100
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": depth + 20, "temperature": 0,
            "structured_outputs": {"regex": '\\{"a": \\[{%d}\\]{%d}\\}' % (depth, depth)},
            "logit_bias": {"15505": 100, "5053": 100}}  # "[[" and "]]"
    expected = '{"a": ' + "[" * depth + "]" * depth + "}"
    with TestClient(make_app(tiny_engine)) as client:
        wait_ready(client)
        first, again = (client.post("/v1/chat/completions", json=body) for _ in range(2))
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    for r in (first, again):
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
    assert again.json()["qvl"]["timings"]["cached"] == {"answer": True}
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expected
