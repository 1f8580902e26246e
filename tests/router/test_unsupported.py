"""Never silent: parameters pdserve does not implement are a 400 naming them unless neutral,
informational fields are accepted, unknown fields are accepted with one bounded warning per
name. Against `create_app` with no node: a request that passes validation gets 503."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.unsupported import (
    MAX_LOGGED_NAME_CHARS,
    NOT_IMPLEMENTED,
    UnknownFieldLog,
)
from tests.router.unlooped import unlooped_router_config

MODEL = "tiny"
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
ROUTES = [COMPLETION, CHAT]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    config = unlooped_router_config(tiny_llama_dir, MODEL)
    return TestClient(create_app(config))


def post(client, route, **fields):
    path, body = route
    return client.post(path, json={**body, **fields})


REFUSED = [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", {"name": "f"}),
    ("length_penalty", 0.5),
    ("best_of", 3),
    ("suffix", " the end"),
    ("use_beam_search", True),
]

NEUTRAL = [
    ("presence_penalty", 0),
    ("presence_penalty", 0.0),
    ("presence_penalty", None),
    ("frequency_penalty", 0),
    ("repetition_penalty", 1),
    ("repetition_penalty", 1.0),
    ("logit_bias", {}),
    ("logit_bias", None),
    ("tools", []),
    ("tools", None),
    ("tool_choice", "none"),
    ("tool_choice", "auto"),
    ("tool_choice", None),
    ("functions", None),
    ("function_call", None),
    ("response_format", {"type": "text"}),
    ("echo", False),
    ("best_of", None),
    ("best_of", 1),
    ("suffix", None),
    ("suffix", ""),
    ("min_p", 0),
    ("parallel_tool_calls", True),
    ("parallel_tool_calls", False),
    ("prompt_logprobs", None),
    ("guided_json", None),
    # informational
    ("user", "someone"),
    ("metadata", {"team": "a"}),
    ("store", False),
    ("service_tier", "auto"),
]


@pytest.mark.parametrize("route", ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize(("name", "value"), REFUSED)
def test_a_parameter_that_is_not_implemented_is_400_naming_it(client, route, name, value):
    r = post(client, route, **{name: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name
    assert error["type"] == "invalid_request_error"
    assert f"'{name}' is not supported" in error["message"]


@pytest.mark.parametrize("route", ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize(("name", "value"), NEUTRAL)
def test_a_neutral_or_informational_value_is_accepted(client, route, name, value):
    r = post(client, route, **{name: value})
    assert r.status_code == 503, r.text  # past validation: no node is alive


# implemented since (router/api/echo.py): past validation on the routes that take them
IMPLEMENTED = [
    (COMPLETION, "echo", True),
    (COMPLETION, "prompt_logprobs", 0),
    (CHAT, "prompt_logprobs", 3),
]


@pytest.mark.parametrize(("route", "name", "value"), IMPLEMENTED)
def test_echo_and_prompt_logprobs_are_implemented(client, route, name, value):
    assert name not in NOT_IMPLEMENTED
    r = post(client, route, **{name: value})
    assert r.status_code == 503, r.text  # past validation: no node is alive


def test_best_of_equal_to_n_is_accepted_and_other_values_are_refused(client):
    assert post(client, COMPLETION, n=2, best_of=2).status_code == 503
    assert post(client, COMPLETION, n=2, best_of=1).json()["error"]["param"] == "best_of"


def test_tools_and_structured_output_are_implemented(client):
    for name in ("tools", "tool_choice", "response_format", "guided_json", "structured_outputs"):
        assert name not in NOT_IMPLEMENTED
    assert post(client, CHAT, tools=[TOOL], tool_choice="auto").status_code == 503
    assert post(client, CHAT, tools=[TOOL], tool_choice="required").status_code == 503
    assert post(client, COMPLETION, guided_regex="[a-z]+").status_code == 503


def test_every_table_entry_accepts_null_and_refuses_a_changed_value():
    for name, param in NOT_IMPLEMENTED.items():
        assert param.neutral(None, {}), name
        assert not param.neutral({"changed": 1}, {}), name


HISTORY_CASES = [
    ({"role": "function", "content": "42", "name": "f"}, "messages[2].role"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}},
     "messages[2].function_call"),
]


@pytest.mark.parametrize(("message", "param"), HISTORY_CASES)
def test_legacy_function_calls_in_the_history_are_400_naming_the_message(client, message, param):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, message]
    r = post(client, CHAT, messages=messages)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "not supported" in error["message"]


def test_tool_calls_and_tool_messages_in_the_history_are_accepted(client):
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "tool_calls": []},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert post(client, CHAT, messages=messages).status_code == 503


def test_unknown_fields_are_accepted_with_one_warning_per_name(client, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.router.api.unsupported")
    for _ in range(3):
        r = post(client, COMPLETION, frobnicate_once=1, other_unknown_field=[1])
        assert r.status_code == 503, r.text
    lines = [rec.getMessage() for rec in caplog.records]
    assert sum("'frobnicate_once'" in line for line in lines) == 1
    assert sum("'other_unknown_field'" in line for line in lines) == 1
    assert all("/v1/completions" in line for line in lines)


def test_a_chat_only_field_on_completions_is_unknown(client, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.router.api.unsupported")
    assert post(client, COMPLETION, max_completion_tokens=3).status_code == 503
    assert any("'max_completion_tokens'" in rec.getMessage() for rec in caplog.records)


def test_the_unknown_field_log_is_bounded_in_names_and_length(caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.router.api.unsupported")
    log = UnknownFieldLog(max_names=3)
    log.note("/r", [f"field_{i}" for i in range(1000)])
    log.note("/r", ["x" * 100_000, "late\n\x00name"])
    assert len(log.warned) == 3
    assert len(caplog.records) == 4  # three names, then once that it stops
    assert "further ones are ignored" in caplog.records[-1].getMessage()
    caplog.clear()
    wide = UnknownFieldLog()
    wide.note("/r", ["y" * 100_000, "bad\nname"])
    logged = [rec.getMessage() for rec in caplog.records]
    assert all(len(line) < MAX_LOGGED_NAME_CHARS + 100 for line in logged)
    assert "bad?name" in logged[1] and "\n" not in logged[1]
    assert max(len(name) for name in wide.warned) <= MAX_LOGGED_NAME_CHARS + 3
