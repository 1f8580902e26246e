"""Router request validation and error shapes, against `create_app` with no node process.

A live node is simulated only by storing a NodeStats in the app's node client (state
injection); nothing is mocked and no socket is opened (the lifespan does not run).
"""

from __future__ import annotations

import json
import time

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.schemas import CompletionRequest
from pdserve.router.api.validation import plan_completion
from pdserve.router.config import RouterConfig
from tests.router.unlooped import node_stats, unlooped_router_config

MODEL = "tiny"
KEY = "sekret-key"


@pytest.fixture(scope="module")
def app(tiny_llama_dir):
    config = unlooped_router_config(
        tiny_llama_dir,
        MODEL,
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: the timeout must hold
        max_body_bytes=4096,
    )
    return create_app(config)


@pytest.fixture
def client(app):
    app.state.router.client.nodes[0].stats = None  # no live node unless a test injects one
    return TestClient(app)


@pytest.fixture
def live(app, client):
    app.state.router.client.record_stats(node_stats())
    return client


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_health_without_node_is_503(client):
    assert_error(client.get("/health"), 503)


def test_health_with_live_node_is_200(live):
    assert live.get("/health").status_code == 200


def test_node_that_stopped_reporting_is_dead(app, client):
    node = app.state.router.client.record_stats(node_stats())
    node.last_seen = time.monotonic() - app.state.router.client.node_timeout_s - 1
    assert client.get("/health").status_code == 503


def test_valid_requests_without_node_get_503(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert_error(r, 503)
    ints_for_floats = {"prompt": [5, 6], "temperature": 0, "top_p": 1, "unknown_extra": 1}
    assert_error(client.post("/v1/completions", json=ints_for_floats), 503)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert_error(r, 503)


def test_the_model_routes_say_503_with_retry_after_until_a_node_can_serve(client):
    for route in ("/v1/models", f"/v1/models/{MODEL}"):
        answer = client.get(route)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "service_unavailable_error"
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"


def test_models_lists_served_name_and_no_path_of_the_host(app, live):
    data = live.get("/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == MODEL
    assert data["data"][0]["root"] == MODEL
    assert str(app.state.router.config.model_path) not in json.dumps(data)


COMPLETION_CASES = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 3}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("extra", "param"), COMPLETION_CASES)
def test_completion_bad_parameters_are_400(client, extra, param):
    body = {"model": MODEL, "prompt": "hello", **extra}
    error = assert_error(client.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_missing_prompt_is_400(client):
    assert_error(client.post("/v1/completions", json={"model": MODEL}), 400, "prompt")


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 100}, "n"),
    ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
]

# Checked where the conversation is rendered, once a node can serve it.
CHAT_TEMPLATE_CASES = [
    ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs.eos_token"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"deep": [[[[[[[[1]]]]]]]]}}, "chat_template_kwargs"),
    (
        {"messages": [{"role": "assistant", "content": " "}], "add_generation_prompt": False,
         "continue_final_message": True},
        "messages",
    ),
]


@pytest.mark.parametrize(("extra", "param"), CHAT_CASES)
def test_chat_bad_parameters_are_400(client, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(("extra", "param"), CHAT_TEMPLATE_CASES)
def test_chat_template_options_out_of_bounds_are_400(live, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    assert_error(live.post("/v1/chat/completions", json=body), 400, param)


def test_type_errors_never_echo_input(client):
    secret = "do-not-echo-this-value"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": secret})
    assert_error(r, 400, "max_tokens")
    assert secret not in r.text


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"\xff\xfe{}", b"[1, 2]", b'{"prompt": NaN}', b"", b'"text"'],
)
def test_malformed_bodies_are_400(client, body):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_oversized_body_is_413(client):
    body = {"model": MODEL, "prompt": "x" * 10_000}
    assert_error(client.post("/v1/completions", json=body), 413)


def test_unknown_model_is_404(client):
    r = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    error = assert_error(r, 404, "model")
    assert error["code"] == "model_not_found"


def test_unknown_route_has_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)


def test_token_ids_outside_vocabulary_are_400(live):
    r = live.post("/v1/completions", json={"model": MODEL, "prompt": [5, 512], "max_tokens": 1})
    assert_error(r, 400, "prompt")
    r = live.post("/v1/completions", json={"model": MODEL, "prompt": [-1], "max_tokens": 1})
    assert_error(r, 400, "prompt")


def test_context_length_is_checked(live):
    r = live.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 10})
    error = assert_error(r, 400)
    assert "maximum context length" in error["message"]
    assert "64" in error["message"] and "70" in error["message"]
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 100}]}
    error = assert_error(live.post("/v1/chat/completions", json=long_chat), 400)
    assert "maximum context length" in error["message"]


GATED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def test_a_full_queue_is_429_before_the_body_is_read(app, live):
    """The overload gate answers before the route runs: a body that would be a 400 is a 429,
    with the request id and Retry-After, counted as a rate-limit error; other routes pass."""
    config = app.state.router.config
    errors = app.state.router.metrics.request_errors.labels("rate_limit_error")
    saved, refused_before = config.max_queued_requests, errors._value.get()
    config.max_queued_requests = 0
    try:
        answers = [
            live.post(path, content=b"{not json", headers={"x-request-id": f"gate-{i}"})
            for i, path in enumerate(GATED_PATHS)
        ]
        models = live.get("/v1/models")
    finally:
        config.max_queued_requests = saved
    for i, r in enumerate(answers):
        assert assert_error(r, 429)["code"] == "rate_limit_exceeded"
        assert r.headers["retry-after"] == "1" and r.headers["x-request-id"] == f"gate-{i}"
    assert errors._value.get() - refused_before == len(GATED_PATHS)
    assert models.status_code == 200
    ok = live.post("/v1/completions", content=b"{not json")  # room again: the route reads it
    assert_error(ok, 400)


def test_metrics_are_prometheus_text(client):
    client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    r = client.get("/metrics")
    assert r.status_code == 200
    assert "pdserve_request_errors_total" in r.text
    assert "pdserve_time_to_first_token_seconds_bucket" in r.text


@pytest.fixture(scope="module")
def keyed_app(tiny_llama_dir, app):
    config = RouterConfig(
        model_path=tiny_llama_dir,
        served_model_name=MODEL,
        api_key=KEY,
        node_addresses=["tcp://127.0.0.1:1"],
        listen_address="tcp://127.0.0.1:2",
    )
    return create_app(config, tokenizer=app.state.router.tokenizer)


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", "Bearer"])
def test_bad_or_missing_api_key_is_401(keyed_app, header):
    client = TestClient(keyed_app)
    headers = {"authorization": header} if header else {}
    body = {"model": MODEL, "prompt": "hi"}
    error = assert_error(client.post("/v1/completions", json=body, headers=headers), 401)
    assert error["code"] == "invalid_api_key"
    assert_error(client.get("/v1/models", headers=headers), 401)


def test_the_api_key_is_checked_before_the_overload_gate(keyed_app):
    config = keyed_app.state.router.config
    saved, config.max_queued_requests = config.max_queued_requests, 0
    try:
        client = TestClient(keyed_app)
        stranger = client.post("/v1/completions", content=b"{}")
        keyed = client.post(
            "/v1/completions", content=b"{}", headers={"authorization": f"Bearer {KEY}"}
        )
    finally:
        config.max_queued_requests = saved
    assert_error(stranger, 401)
    assert_error(keyed, 429)


def test_right_api_key_passes_and_health_needs_none(keyed_app):
    client = TestClient(keyed_app)
    r = client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 503  # the key passes (no 401); no node can serve yet
    assert client.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 503  # no node, but no 401 either


LONE_SURROGATE_FIELDS = [
    ("/v1/completions", {"prompt": "ok \ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a\ud800"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a", "\udfff"]}, "guided_choice[1]"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: \"\ud800\""}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {"a": {"enum": ["\ud800"]}}}}}},
     "response_format.json_schema.schema.properties.a.enum[0]"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "object", "properties": {"\ud800": {"type": "string"}}}}}},
     "response_format.json_schema.schema.properties"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
]


@pytest.mark.parametrize(("route", "fields", "param"), LONE_SURROGATE_FIELDS)
def test_a_lone_surrogate_anywhere_in_a_body_is_400_naming_where(live, route, fields, param):
    """JSON may escape one ("\\ud800"); no tokenizer, grammar or msgpack encoder takes it."""
    body = json.dumps({"model": MODEL, "max_tokens": 2, **fields})  # escapes it as \ud800
    response = live.post(route, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, param)


def test_priority_is_the_operators_to_give(tiny_llama_dir, app, live):
    """Without --allow-client-priority a priority other than 0 is refused by name; with it the
    request goes through."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(live.post("/v1/completions", json={**body, "priority": -5}), 400, "priority")
    assert_error(live.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": 1,
    }), 400, "priority")
    allowed = unlooped_router_config(
        tiny_llama_dir, MODEL, node_timeout_s=30.0, allow_client_priority=True
    )
    request = CompletionRequest.model_validate({**body, "priority": -5})
    plan = plan_completion(request, allowed, app.state.router.tokenizer, lambda: (64, 512))
    assert plan.priority == -5


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 3}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_max_logprobs_bounds_every_logprob_count(tiny_llama_dir, path, extra, param):
    config = unlooped_router_config(tiny_llama_dir, MODEL, node_timeout_s=30.0, max_logprobs=2)
    client = TestClient(create_app(config))
    error = assert_error(client.post(path, json={"model": MODEL, **extra}), 400, param)
    assert "at most 2" in error["message"] and "--max-logprobs" in error["message"]
    within = {**extra, param: 2} if param != "top_logprobs" else {**extra, "top_logprobs": 2}
    assert client.post(path, json={"model": MODEL, **within}).status_code != 400
