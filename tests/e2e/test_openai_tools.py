"""End to end with the openai client on the default model (`pdserve serve`, real processes):
structured output (`response_format` json_schema and json_object, vLLM's `guided_choice` and
`guided_regex` through `extra_body`) parses and validates, and tool calls forced by
`tool_choice` come back as `tool_calls` whose arguments validate against the function's
parameters, streamed or not; a tool message in the history is accepted."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.default_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time.",
                                      "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def validate(value: Any, schema: dict) -> None:
    """The subset of JSON schema these tests use (jsonschema is no dependency)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema.get("required", [])) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), value
        for key, item in value.items():
            if key in schema.get("properties", {}):
                validate(item, schema["properties"][key])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert type(value) is int, value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, **fields):
    fields = {"messages": ASK, "temperature": 0, "max_tokens": 96, **fields}
    return client.chat.completions.create(model=model, **fields)


def test_response_format_json_schema_output_validates(client, model):
    out = chat(
        client, model,
        messages=[{"role": "user", "content": "Invent a person: name, age and city."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_output_is_an_object(client, model):
    out = chat(
        client, model,
        messages=[{"role": "user", "content": "Give a JSON object with a colour and a number."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_guided_choice_and_regex_through_extra_body(client, model):
    choices = ["positive", "negative", "neutral"]
    out = chat(client, model, messages=[{"role": "user", "content": "Sentiment of: I love it!"}],
               extra_body={"guided_choice": choices})
    assert out.choices[0].message.content in choices
    out = client.completions.create(
        model=model, prompt="Today's date is", max_tokens=20, temperature=0,
        extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out.choices[0].text)
    out = chat(client, model, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")


def test_two_structured_output_fields_are_refused(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, model, response_format={"type": "json_object"},
             extra_body={"guided_regex": "a+"})
    assert error.value.body["param"] == "guided_regex"


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_tool_choice_required_returns_valid_tool_calls(client, model, parallel):
    out = chat(client, model, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
               max_tokens=160)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_a_named_function_returns_its_call_with_valid_arguments(client, model):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = chat(client, model, tools=TOOLS, tool_choice=named)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_calls([call])


def test_streamed_tool_call_deltas_reassemble_into_the_same_call(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    plain = chat(client, model, tools=TOOLS, tool_choice=named).choices[0].message.tool_calls[0]
    name, arguments, ids, finish = None, "", set(), None
    for chunk in chat(client, model, tools=TOOLS, tool_choice=named, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            ids |= {delta.id} - {None}
            if delta.function.name:
                name = delta.function.name
            arguments += delta.function.arguments or ""
    assert finish == "tool_calls" and len(ids) == 1
    assert (name, arguments) == (plain.function.name, plain.function.arguments)

    required = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 160}
    whole = chat(client, model, **required).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    for chunk in chat(client, model, stream=True, **required):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            call["name"] = delta.function.name or call["name"]
            call["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_a_tool_result_in_the_history_is_accepted(client, model):
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 degrees, sunny"},
    ]
    out = chat(client, model, messages=messages, tools=TOOLS, max_tokens=32)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_auto_on_a_template_without_tools_answers_well_formed(client, model):
    out = chat(client, model, tools=TOOLS, tool_choice="auto", max_tokens=48)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(c.function.name in PARAMETERS for c in choice.message.tool_calls)
    else:
        assert isinstance(choice.message.content, str)
