"""Structured output in the API: `response_format`, vLLM's `structured_outputs` and `guided_*`
map to the one `structured_output` sampling argument every choice is sent with, on both
routes; at most one per request; shape errors are 400s naming the API field."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.api.structured import structured_output_of
from pdserve.router.api.unsupported import NOT_IMPLEMENTED
from pdserve.router.api.validation import plan_chat, plan_completion
from pdserve.wire.limits import MAX_CHOICES, MAX_JSON_SCHEMA_DEPTH
from tests.router.unlooped import unlooped_router_config

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar")

MAPPING = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     {"json_object": True}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": '{"type": "object"}'}}, {"json_schema": {"type": "object"}}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, {"grammar": 'start: "a"'}),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"guided_json": '{"type": "object"}'}, {"json_schema": {"type": "object"}}),
    ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'start: "a" | "b"'}, {"grammar": 'start: "a" | "b"'}),
    ({}, None),
]


@pytest.fixture(scope="module")
def config(tiny_llama_dir):
    return unlooped_router_config(tiny_llama_dir, MODEL)


@pytest.fixture(scope="module")
def client(config):
    return TestClient(create_app(config))


def limits():
    return 4096, 512


@pytest.mark.parametrize(("fields", "spec"), MAPPING)
def test_each_field_maps_to_its_spec_on_every_choice_of_both_routes(
    config, tokenizer, fields, spec
):
    completion = CompletionRequest.model_validate(
        {"prompt": ["a", "b"], "n": 2, "max_tokens": 4, **fields}
    )
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4, **fields}
    )
    plans = [plan_completion(completion, config, tokenizer, limits),
             plan_chat(chat, config, tokenizer, limits)]
    for plan in plans:
        assert [s.structured_output for s in plan.samplings] == [spec] * plan.n
        if spec is None:
            assert all(s.structured_output is None for s in plan.samplings)


def test_the_fields_are_implemented_not_refused():
    assert not set(FIELDS) & set(NOT_IMPLEMENTED)


def test_two_fields_asking_for_structured_output_are_400_naming_the_second(client):
    body = {"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
    error = client.post("/v1/completions", json=body).json()["error"]
    assert error["param"] == "guided_choice" and "guided_regex" in error["message"]
    body = {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}}
    assert client.post("/v1/completions", json=body).json()["error"]["param"] == (
        "structured_outputs"
    )
    # {"type": "text"} asks for nothing
    req = CompletionRequest.model_validate(
        {"prompt": "x", "response_format": {"type": "text"}, "guided_regex": "a"}
    )
    assert structured_output_of(req) == ({"regex": "a"}, "guided_regex")


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "t", "schema": nested(MAX_JSON_SCHEMA_DEPTH)}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "t", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_grammar": "x" * 200_000}, "guided_grammar"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_shape_is_400_naming_the_field(client, route, fields, param):
    base = {"prompt": "x"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]
    }
    r = client.post(route, json={"model": MODEL, **base, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert not re.search(r"structured_output\b", error["message"]), error["message"]


def test_a_valid_spec_passes_validation_without_a_node(client):
    body = {"model": MODEL, "prompt": "x", "guided_choice": ["yes", "no"]}
    assert client.post("/v1/completions", json=body).status_code == 503
