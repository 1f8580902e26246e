"""Penalties, min_p, logit_bias and stop_token_ids: bounded where they enter (a 400 naming the
field, by SamplingParams' construction and the vocabulary), passed to the node as SamplingParams
(logit_bias keys as token ids), and the defaults when neutral or absent."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.sampling import choice_samplings, request_sampling
from pdserve.router.api.schemas import CompletionRequest
from pdserve.wire.sampling_params import SamplingParams
from tests.router.test_validation import assert_error
from tests.router.unlooped import node_stats, unlooped_router_config

MODEL = "tiny"
VOCAB = 512


@pytest.fixture(scope="module")
def live(tiny_llama_dir):
    config = unlooped_router_config(
        tiny_llama_dir,
        MODEL,
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: the timeout must hold
    )
    app = create_app(config)
    app.state.router.client.record_stats(node_stats(vocab_size=VOCAB))
    return TestClient(app)


def request(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 1e300}, "frequency_penalty"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 12}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias"),
    ({"logit_bias": {"9" * 400: 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids[0]"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(("fields", "param"), BAD)
def test_out_of_range_controls_are_400_naming_the_field(live, route, fields, param):
    if route == "completions":
        path, body = "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    else:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(live.post(path, json={**body, **fields}), 400, param)


def test_controls_become_sampling_params_the_engine_accepts():
    req = request(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias={"07": -100, "300": 2.5},
        stop_token_ids=[2, 9],
    )
    (sampling,) = choice_samplings(request_sampling(req, 4, None), 4, VOCAB, 1)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert (sampling.repetition_penalty, sampling.min_p) == (1.2, 0.05)
    assert sampling.logit_bias == {7: -100.0, 300: 2.5} and sampling.stop_token_ids == [2, 9]
    assert SamplingParams.from_wire(sampling.to_wire()) == sampling  # as the node gets them


def test_neutral_or_absent_controls_are_the_defaults():
    neutral = request(
        presence_penalty=0,
        frequency_penalty=0.0,
        repetition_penalty=1,
        min_p=0,
        logit_bias={},
        stop_token_ids=[],
    )
    for req in (neutral, request()):
        (sampling,) = choice_samplings(request_sampling(req, 4, None), 4, VOCAB, 1)
        assert sampling == SamplingParams(max_tokens=4)
        assert not sampling.penalized
