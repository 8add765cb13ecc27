"""Structured outputs and tools through real clients, unchanged, against a live `qvl serve` on
the tiny random checkpoint. Random weights are the point: whatever the model would say, a
constrained answer must parse and validate, every time."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server_support import live_server, png_bytes

pytestmark = pytest.mark.slow  # a `qvl serve` subprocess

SEEDS = range(4)


class Item(BaseModel):
    name: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)


class Receipt(BaseModel):
    store: str = Field(max_length=16)
    currency: Literal["EUR", "USD", "CNY"]
    paid: bool
    items: list[Item] = Field(max_length=3)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with live_server(tiny_checkpoint, "--request-timeout", "120") as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def receipt_prompt() -> list[dict]:
    image = "data:image/png;base64," + __import__("base64").b64encode(png_bytes(64, 48)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "Read this receipt."}]}]


@pytest.mark.parametrize("seed", SEEDS)
def test_parse_with_a_pydantic_model_always_validates(client, seed):
    r = client.chat.completions.parse(model="tiny", messages=receipt_prompt(), response_format=Receipt,
                                      temperature=1.0, seed=seed, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Receipt)  # the client validated it
    assert Receipt.model_validate_json(choice.message.content) == choice.message.parsed


def test_streamed_parse_validates(client):
    with client.chat.completions.stream(model="tiny", messages=receipt_prompt(), response_format=Receipt,
                                        temperature=1.0, seed=7, max_tokens=400) as stream:
        pieces = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 1 and "".join(pieces) == final.choices[0].message.content
    assert isinstance(final.choices[0].message.parsed, Receipt)


def test_json_object_and_choice_and_regex(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give JSON"}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=300)
    if r.choices[0].finish_reason == "stop":  # an open object may run to the limit on random weights
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Cat or dog?"}],
                                       temperature=1.0, seed=3, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": ["cat", "dog", "neither"]}})
    assert r.choices[0].message.content in ("cat", "dog", "neither")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A date?"}],
                                       temperature=1.0, seed=3, max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert __import__("re").fullmatch(r"20\d\d-[01]\d-[0-3]\d", r.choices[0].message.content)


@pytest.mark.parametrize("seed", SEEDS)
def test_required_tool_call_round_trip(client, seed):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
            assert isinstance(args["city"], str) and len(args["city"]) <= 20
        else:
            assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    # the results go back; the model answers (or calls again: auto)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
                 for call in choice.message.tool_calls]
    follow = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                            temperature=0, max_tokens=5)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_call_streams_id_name_then_arguments(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
        temperature=1.0, seed=1, max_tokens=100)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            if piece.id is not None:  # the first piece of a call names it
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="tiny", temperature=1.0, seed=5,
                     max_tokens=400, max_retries=0)
    receipt = llm.with_structured_output(Receipt).invoke("Read the receipt: Cafe Rosa, 2 coffees, EUR, paid.")
    assert isinstance(receipt, Receipt)


# -- the Responses API -------------------------------------------------------------------------


def responses_input(text: str) -> list[dict]:
    image = receipt_prompt()[0]["content"][0]["image_url"]["url"]
    return [{"role": "user", "content": [{"type": "input_text", "text": text},
                                         {"type": "input_image", "image_url": image}]}]


def test_responses_stream_with_an_image(client):
    stream = client.responses.create(model="tiny", input=responses_input("Describe it."), instructions="Be brief.",
                                     stream=True, max_output_tokens=8, temperature=0)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and final.output_text == deltas and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens > 64  # the image's tokens count
    plain = client.responses.create(model="tiny", input=responses_input("Describe it."), instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert plain.output_text == deltas and plain.status == "incomplete"


def test_responses_parse_follows_a_schema(client):
    r = client.responses.parse(model="tiny", input=responses_input("Read the receipt."), text_format=Receipt,
                               temperature=1.0, max_output_tokens=400)
    assert r.status == "completed" and isinstance(r.output_parsed, Receipt)


def test_responses_function_call_round_trip(client):
    tools = [{"type": "function", **WEATHER["function"]}]
    # one call: sampled parallel calls may run past max_output_tokens, and a cut call cannot be sent back
    r = client.responses.create(model="tiny", input="Weather in Oslo?", tools=tools, tool_choice="required",
                                parallel_tool_calls=False, temperature=1.0, max_output_tokens=200)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    assert json.loads(calls[0].arguments)["unit"] in ("celsius", "fahrenheit")
    follow = client.responses.create(
        model="tiny", tools=tools, temperature=0, max_output_tokens=4,
        input=[{"role": "user", "content": "Weather in Oslo?"},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": "12 C"} for c in calls]])
    assert follow.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="tiny", input=[{"type": "function_call_output", "call_id": "nope",
                                                      "output": "1"}])
    assert bad.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert bad.value.body["code"] == "unsupported_parameter"
