"""`GET /v1/models/{id}`, `POST /tokenize` and `POST /detokenize` (router/api/tokenization.py):
vLLM's shapes, answers equal to the tokenizer's, inputs bounded and refused by field name."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.text.chat_template import TemplateOptions
from tests.router.test_validation import assert_error
from tests.router.unlooped import node_stats, unlooped_router_config

MODEL = "org/tiny-model"  # an id with a slash, as a model path would be
TEXT = "The capital of France is Paris."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


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
    app.state.router.client.nodes[0].stats = None
    return TestClient(app)


@pytest.fixture
def live(app, client):
    app.state.router.client.record_stats(node_stats(max_model_len=64))
    return client


@pytest.fixture
def tokenizer(app):
    return app.state.router.tokenizer


def test_a_model_is_retrieved_by_its_id(live):
    card = live.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 64
    assert card == live.get("/v1/models").json()["data"][0]


def test_an_unknown_model_id_is_404_with_an_openai_error(client):
    error = assert_error(client.get("/v1/models/no-such-model"), 404, "model")
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    assert_error(client.get(f"/v1/models/{MODEL}/extra"), 404, "model")


def test_tokenize_a_prompt_equals_the_tokenizer(live, tokenizer):
    out = live.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    assert out == {"count": len(tokenizer.encode(TEXT)), "max_model_len": 64,
                   "tokens": tokenizer.encode(TEXT)}
    bare = live.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    strs = live.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert strs["token_strs"] == [tokenizer.convert_ids_to_tokens(t) for t in strs["tokens"]]


def test_tokenize_messages_equals_the_chat_template(live, tokenizer):
    body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True}
    out = live.post("/tokenize", json=body).json()
    assert out["tokens"] == tokenizer.apply_chat_template(MESSAGES)
    assert out["count"] == len(out["tokens"])


def test_tokenize_messages_takes_the_template_options(live, tokenizer):
    body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    out = live.post("/tokenize", json=body).json()
    options = TemplateOptions(add_generation_prompt=False, continue_final_message=True,
                              kwargs={"enable_thinking": False})
    assert out["tokens"] == tokenizer.apply_chat_template(MESSAGES, options=options)
    assert out["tokens"] != tokenizer.apply_chat_template(MESSAGES)


def test_detokenize_round_trips_the_tokenizer(live, tokenizer):
    ids = live.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).json()["tokens"]
    out = live.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert out == {"prompt": tokenizer.decode(ids)}
    assert TEXT in out["prompt"]


def test_detokenize_needs_no_live_node(client, tokenizer):
    r = client.post("/detokenize", json={"tokens": [5, 6, 7]})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode([5, 6, 7])


BAD_TOKENIZE = [
    ({}, 400, "prompt"),
    ({"prompt": TEXT, "messages": MESSAGES}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": TEXT, "model": "other"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs.tools"),
    ({"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ({"messages": MESSAGES, "chat_template": "{{ x }}"}, 400, "chat_template"),
    ({"messages": [{"role": "function", "content": "1"}]}, 400, "messages[0].role"),
    ({"prompt": "x" * 3000}, 400, "prompt"),  # more characters than 64 tokens can hold
    ({"prompt": "x" * 5000}, 413, None),
    ({"prompt": TEXT, "return_token_strs": "yes"}, 400, "return_token_strs"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_TOKENIZE)
def test_bad_tokenize_requests_name_the_field(live, body, status, param):
    assert_error(live.post("/tokenize", json=body), status, param)


BAD_DETOKENIZE = [
    ({}, 400, "tokens"),
    ({"tokens": "5 6"}, 400, "tokens"),
    ({"tokens": [5, "6"]}, 400, "tokens[1]"),
    ({"tokens": [5, 1.0]}, 400, "tokens[1]"),
    ({"tokens": [5, -1]}, 400, "tokens"),
    ({"tokens": [5, 2**70]}, 400, "tokens"),
    ({"tokens": [5], "model": "other"}, 404, "model"),
    ({"tokens": [55] * 2000}, 413, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_DETOKENIZE)
def test_bad_detokenize_requests_name_the_field(client, body, status, param):
    assert_error(client.post("/detokenize", json=body), status, param)


def test_detokenize_refuses_ids_past_the_tokenizers_vocabulary(client, tokenizer):
    error = assert_error(client.post("/detokenize", json={"tokens": [len(tokenizer)]}), 400,
                         "tokens")
    assert str(len(tokenizer)) in error["message"]


def test_tokenize_without_a_live_node_is_503(client):
    assert_error(client.post("/tokenize", json={"prompt": TEXT}), 503)


def test_unknown_tokenize_fields_are_accepted(live):
    assert live.post("/tokenize", json={"prompt": TEXT, "frobnicate": 1}).status_code == 200


def test_tokenize_and_detokenize_go_through_admission(app, live):
    """Refused with 429 while the router's queue is full, like the generation routes; one
    place taken while the tokenizer job runs, given back after."""
    admission = app.state.router.admission
    full = app.state.router.config.max_queued_requests
    admission.num_requests = full
    try:
        assert_error(live.post("/tokenize", json={"model": MODEL, "prompt": TEXT}), 429)
        assert_error(live.post("/detokenize", json={"model": MODEL, "tokens": [5, 6]}), 429)
    finally:
        admission.num_requests = 0
    held = []
    real_run = app.state.router.tokenizer_threads.run

    async def watching_run(*args):
        held.append(admission.num_requests)
        return await real_run(*args)

    app.state.router.tokenizer_threads.run = watching_run
    try:
        assert live.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).status_code == 200
        assert live.post("/detokenize", json={"model": MODEL, "tokens": [5]}).status_code == 200
    finally:
        del app.state.router.tokenizer_threads.run
    assert held == [1, 1] and admission.num_requests == 0
