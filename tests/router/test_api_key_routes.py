"""Which routes the API key guards (router/api/auth.py): as vLLM, only /v1/ by default; every
route but the probes with --api-key-guards-every-route. Against `create_app` with no node."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.auth import key_required
from tests.router.unlooped import unlooped_router_config

MODEL = "tiny"
KEY = "sekret-key"
GOOD = {"authorization": f"Bearer {KEY}"}
OPEN_BY_DEFAULT = [
    ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"),
    ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
]
GUARDED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]


def keyed_client(tiny_llama_dir, tokenizer, **settings) -> TestClient:
    config = unlooped_router_config(tiny_llama_dir, MODEL, api_key=KEY, **settings)
    return TestClient(create_app(config, tokenizer=tokenizer))


def call(client: TestClient, method: str, path: str, headers=None):
    body = {"model": MODEL, "prompt": "hi", "tokens": [1]} if method == "POST" else None
    return client.request(method, path, json=body, headers=headers or {})


@pytest.mark.parametrize(("method", "path"), OPEN_BY_DEFAULT)
def test_by_default_the_key_leaves_the_routes_outside_v1_open(
    tiny_llama_dir, tokenizer, method, path
):
    response = call(keyed_client(tiny_llama_dir, tokenizer), method, path)
    assert response.status_code != 401, response.text


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_the_v1_routes_need_the_key(tiny_llama_dir, tokenizer, method, path):
    client = keyed_client(tiny_llama_dir, tokenizer)
    assert call(client, method, path).status_code == 401
    assert call(client, method, path, GOOD).status_code != 401


@pytest.mark.parametrize(("method", "path"), [*GUARDED, *OPEN_BY_DEFAULT[3:]])
def test_guarding_every_route_leaves_only_the_probes_open(tiny_llama_dir, tokenizer, method, path):
    client = keyed_client(tiny_llama_dir, tokenizer, api_key_guards_every_route=True)
    assert call(client, method, path).status_code == 401
    assert call(client, method, path, GOOD).status_code != 401
    for probe in ("/health", "/ping"):
        assert client.get(probe).status_code != 401


def test_the_rule_reads_the_path_less_the_root_path_and_never_guards_options():
    assert key_required("POST", "/v1/completions", every_route=False)
    assert key_required("GET", "/v1", every_route=False)
    assert key_required("GET", "/v1x", every_route=False)  # vLLM's test: the path's start
    assert not key_required("GET", "/metrics", every_route=False)
    assert key_required("GET", "/metrics", every_route=True)
    assert not key_required("OPTIONS", "/v1/completions", every_route=True)
    assert not key_required("GET", "/admin/nodes", every_route=True)  # the admin token's
