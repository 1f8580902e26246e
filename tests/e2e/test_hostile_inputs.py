"""Hostile numbers and strings from clients, over HTTP: a 4xx naming the field, or an answer.

Every number a client sends is bounded where it enters (router/api/validation.py); the engine's own
bounds and step-failure isolation are tests/engine/test_hostile_requests.py. The HTTP tests run
the router in this process, so its admission gauge can be read directly, against a real
colocated node process on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.config import RouterConfig
from tests.fault_checks import stop_process
from tests.nodes.test_colocated_node import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
READY_TIMEOUT_S = 90.0
HUGE_TEXT = "x" * 500_000


# -- the router and a real node ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    """(app, client): the router app in this process, a colocated node process behind it."""
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    log_path = tmp_path_factory.mktemp("hostile-node") / "stderr.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.node", "colocated", "--model", str(tiny_llama_dir),
         "--listen", listen]
        + f"--router {router_address} --node-id node-0 --num-kv-blocks 128".split()
        + ["--num-threads", "1", "--heartbeat-interval", "0.2"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    config = RouterConfig(
        model_path=tiny_llama_dir,
        served_model_name=MODEL,
        node_addresses=[f"node-0={listen}"],
        listen_address=router_address,
    )
    app = create_app(config)
    try:
        with TestClient(app) as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while client.get("/health").status_code != 200:
                assert process.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "the node did not come up in time"
                time.sleep(0.2)
            yield app, client
            assert process.poll() is None, log_path.read_text()[-3000:]
    finally:
        stop_process(process, timeout_s=15)
        log.close()


class Raw(str):
    """A JSON token written as it is: numbers Python's json turns into inf or refuses, and the
    NaN/Infinity tokens that JSON does not allow."""


def encode_body(body: dict) -> bytes:
    raws: dict[str, str] = {}

    def placeholder(value):
        if isinstance(value, Raw):
            key = f"__raw_{len(raws)}__"
            raws[key] = str(value)
            return key
        if isinstance(value, list):
            return [placeholder(v) for v in value]
        if isinstance(value, dict):
            return {k: placeholder(v) for k, v in value.items()}
        return value

    text = json.dumps(placeholder(body))
    for key, token in raws.items():
        text = text.replace(json.dumps(key), token)
    return text.encode()


def post(client: TestClient, path: str, body: dict):
    return client.post(path, content=encode_body(body), headers={"content-type": "application/json"})


def wait_admission_empty(app, timeout_s: float = 5.0) -> None:
    admission = app.state.router.admission
    deadline = time.monotonic() + timeout_s
    while admission.num_requests or admission.num_tokens:
        assert time.monotonic() < deadline, (
            f"admission holds {admission.num_requests} requests, {admission.num_tokens} tokens"
        )
        time.sleep(0.01)


def assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert len(error["message"]) < 600, error["message"][:600]
    return error


# -- hostile numbers and strings, property-based ---------------------------------------------

INT_EXTREMES = [
    0, -1, 1, 2, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
    -(2**64), 10**30,
]
FLOAT_EXTREMES = [1e-320, -1e-320, 1e-6, 0.5, 1.5, 100.0, 100.5, 1e308, -1e308, 2.0**64]
RAW_TOKENS = [
    Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"),
    Raw("9" * 5000),
]
WRONG_TYPES = [None, True, "7", "", "\ud800", [], [3], {}, {"a": 1}, HUGE_TEXT]
HOSTILE_VALUES = INT_EXTREMES + FLOAT_EXTREMES + RAW_TOKENS + WRONG_TYPES
# Ordinary values let a combination get past its first field to the checks behind it.
HOSTILE = st.sampled_from(HOSTILE_VALUES) | st.sampled_from([1, 2, 0.5, "ok", ["ok"]])

NUMERIC_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "min_tokens",
                  "priority"]
STRING_FIELDS = ["stop", "stop[]", "user", "model"]
COMPLETION_FIELDS = [*NUMERIC_FIELDS, *STRING_FIELDS, "logprobs", "prompt", "prompt[]",
                     "prompt[][]", "presence_penalty", "repetition_penalty", "min_p",
                     "logit_bias", "stop_token_ids", "unknown_field"]
CHAT_FIELDS = [*NUMERIC_FIELDS, *STRING_FIELDS, "max_completion_tokens", "logprobs",
               "top_logprobs", "content", "frequency_penalty", "logit_bias"]


def hostile_body(chat: bool, stream: bool, hostile: dict) -> dict:
    body: dict = {"model": MODEL, "max_tokens": 2, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for field, value in hostile.items():
        if field == "prompt[]":
            body["prompt"] = [5, value]
        elif field == "prompt[][]":  # a batch: a second prompt (or what stands for one)
            body["prompt"] = [[5, 6], value]
        elif field == "stop[]":
            body["stop"] = ["\n", value]
        elif field == "content":
            body["messages"][0]["content"] = value
        else:
            body[field] = value
    if "top_logprobs" in hostile and "logprobs" not in hostile:
        body["logprobs"] = True
    return body


def answer_events(response) -> list[dict]:
    """The JSON body, or each SSE event's payload."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return [response.json()]
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _param_root(param: str) -> str:
    return param.split("[")[0].split(".")[0]


def check_hostile(app, client, path: str, body: dict, hostile: dict) -> None:
    """Never a 5xx; a 400 for a body of valid JSON names a field the body has; admission is
    empty again once the answer is in."""
    response = post(client, path, body)
    status = response.status_code
    assert status == 200 or 400 <= status < 500, (status, response.text[:300], hostile)
    if status == 200:
        assert not any("error" in event for event in answer_events(response)), response.text[:300]
    else:
        error = response.json()["error"]
        assert error["message"], error
        raw = any(isinstance(v, Raw) for v in hostile.values())
        if status in (400, 404) and not raw:
            assert error["param"] is not None and _param_root(error["param"]) in body, (
                error, hostile
            )
    wait_admission_empty(app)


ENDPOINTS = [("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)]


@pytest.mark.parametrize(("path", "fields"), ENDPOINTS)
def test_every_field_at_every_extreme_gets_4xx_or_200(served, path, fields):
    """Each field alone at each extreme value (the sweep the property test below samples)."""
    app, client = served
    for field in fields:
        for value in HOSTILE_VALUES:
            hostile = {field: value}
            check_hostile(app, client, path, hostile_body(path.endswith("chat/completions"),
                                                          False, hostile), hostile)


@pytest.mark.parametrize(("path", "fields"), ENDPOINTS)
def test_hostile_fields_get_4xx_or_200_and_never_hold_admission(served, path, fields):
    """Up to three hostile fields at once, streamed or not."""
    app, client = served

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        hostile=st.dictionaries(st.sampled_from(fields), HOSTILE, min_size=1, max_size=3),
        stream=st.booleans(),
    )
    def run(hostile, stream):
        body = hostile_body(path.endswith("chat/completions"), stream, hostile)
        check_hostile(app, client, path, body, hostile)

    run()
    # the node served every request it was given and is still serving
    ok = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# -- the measured bugs, one by one -------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2**63, 2**64, 2**31, -2, -(2**64)])
def test_top_k_that_does_not_fit_int32_is_400_naming_top_k(served, top_k):
    app, client = served
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        assert_error(post(client, path, {**body, "top_k": top_k, "max_tokens": 2}), 400, "top_k")
    wait_admission_empty(app)


def test_top_k_beyond_the_vocabulary_keeps_the_whole_vocabulary(served):
    _, client = served
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    unfiltered = post(client, "/v1/completions", body)
    clamped = post(client, "/v1/completions", {**body, "top_k": 2**31 - 1})
    assert unfiltered.status_code == clamped.status_code == 200, clamped.text[:300]
    assert clamped.json()["choices"][0]["text"] == unfiltered.json()["choices"][0]["text"]


@pytest.mark.parametrize("min_tokens", [2**64, 2**63, 2**31, 2**31 - 1, 17])
def test_min_tokens_beyond_the_completion_limit_is_400_naming_min_tokens(served, min_tokens):
    app, client = served
    # completions: max_tokens defaults to 16; chat: the room the prompt leaves in the context
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "min_tokens": min_tokens}),
                 400, "min_tokens")
    if min_tokens > 1024:
        chat = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": min_tokens}
        assert_error(post(client, "/v1/chat/completions", chat), 400, "min_tokens")
    wait_admission_empty(app)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_that_does_not_fit_int32_is_400_naming_it(served, field):
    _, client = served
    body = {"messages": [{"role": "user", "content": "hi"}], field: 2**64}
    error = assert_error(post(client, "/v1/chat/completions", body), 400, field)
    assert "2,147,483,647" in error["message"]


def test_huge_token_ids_in_the_prompt_are_400_naming_prompt(served):
    _, client = served
    for token in (2**63, 2**64, -(2**64), 10**30):
        body = {"prompt": [5, token], "max_tokens": 2}
        assert_error(post(client, "/v1/completions", body), 400, "prompt")


def test_lone_surrogate_is_400_naming_the_field(served):
    app, client = served
    headers = {"content-type": "application/json"}
    r = client.post("/v1/completions", content=b'{"prompt": "\\ud800"}', headers=headers)
    assert_error(r, 400, "prompt")
    chat = b'{"messages": [{"role": "user", "content": "ok \\udfff"}]}'
    assert_error(client.post("/v1/chat/completions", content=chat, headers=headers), 400,
                 "messages[0].content")
    wait_admission_empty(app)


def test_any_tokenizer_failure_on_the_prompt_is_400_naming_prompt(served, monkeypatch):
    app, client = served

    def refuse(*args, **kwargs):
        raise RuntimeError("the tokenizer gave up")

    monkeypatch.setattr(app.state.router.tokenizer, "encode", refuse)
    error = assert_error(post(client, "/v1/completions", {"prompt": "fine text"}), 400, "prompt")
    assert "gave up" not in error["message"]


def test_huge_strings_are_refused_naming_the_field(served):
    app, client = served
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "stop": HUGE_TEXT}), 400, "stop")
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "stop": ["a", HUGE_TEXT]}),
                 400, "stop")
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "user": HUGE_TEXT}), 400, "user")
    error = assert_error(post(client, "/v1/completions", {"prompt": "hi", "model": HUGE_TEXT}),
                         404, "model")
    assert len(error["message"]) < 200
    assert_error(post(client, "/v1/completions", {"prompt": HUGE_TEXT}), 400, "prompt")
    wait_admission_empty(app)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-6])
def test_temperature_below_1e_5_answers_as_greedy(served, temperature):
    _, client = served
    body = {"prompt": "hello there", "max_tokens": 8, "ignore_eos": True}
    greedy = post(client, "/v1/completions", {**body, "temperature": 0})
    tiny = post(client, "/v1/completions", {**body, "temperature": temperature})
    assert greedy.status_code == tiny.status_code == 200, tiny.text[:300]
    assert tiny.json()["usage"]["completion_tokens"] == 8
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
