"""CORS as vLLM does it (router/api/app.py, Starlette's CORSMiddleware): on by default for every
origin; a browser's preflight gets 200 with the CORS headers and needs no API key."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.router.__main__ import parse_args
from pdserve.router.api.app import create_app
from pdserve.router.config import RouterConfig
from tests.router.unlooped import unlooped_router_config

MODEL = "tiny"
KEY = "sekret-key"
ORIGIN = "https://a.example"
PREFLIGHT = {
    "origin": ORIGIN,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}


def client_of(tiny_llama_dir, tokenizer, **settings) -> TestClient:
    config = unlooped_router_config(tiny_llama_dir, MODEL, **settings)
    return TestClient(create_app(config, tokenizer=tokenizer))


def test_a_preflight_gets_200_with_the_cors_headers_and_needs_no_api_key(tiny_llama_dir, tokenizer):
    client = client_of(tiny_llama_dir, tokenizer, api_key=KEY)
    response = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"


def test_answers_to_a_browser_carry_the_origin_header_errors_included(tiny_llama_dir, tokenizer):
    client = client_of(tiny_llama_dir, tokenizer, api_key=KEY)
    refused = client.post("/v1/completions", json={}, headers={"origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "*"
    assert client.get("/health", headers={"origin": ORIGIN}).headers[
        "access-control-allow-origin"
    ] == "*"


def test_allowed_origins_restrict_the_preflight(tiny_llama_dir, tokenizer):
    client = client_of(
        tiny_llama_dir, tokenizer, allowed_origins=[ORIGIN], allowed_methods=["POST"],
        allow_credentials=True,
    )
    allowed = client.options("/v1/completions", headers=PREFLIGHT)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    stranger = client.options(
        "/v1/completions", headers={**PREFLIGHT, "origin": "https://b.example"}
    )
    assert stranger.status_code == 400
    assert "access-control-allow-origin" not in stranger.headers


def test_the_flags_take_json_lists_as_vllm_does(tiny_llama_dir):
    base = ["--model", str(tiny_llama_dir), "--node", "tcp://127.0.0.1:1",
            "--listen", "tcp://127.0.0.1:2"]
    config, _ = parse_args([
        *base, "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
        "--allowed-headers", '["authorization"]', "--allow-credentials",
    ], environ={})
    assert config.allowed_origins == [ORIGIN]
    assert config.allowed_methods == ["GET", "POST"]
    assert config.allowed_headers == ["authorization"]
    assert config.allow_credentials is True
    default, _ = parse_args(base, environ={})
    assert (default.allowed_origins, default.allow_credentials) == (["*"], False)


@pytest.mark.parametrize("value", ["https://a.example", '{"a": 1}', "[1]", "[\"x\""])
def test_a_flag_that_is_no_json_list_of_strings_is_refused_by_name(tiny_llama_dir, value, capsys):
    base = ["--model", str(tiny_llama_dir), "--node", "tcp://127.0.0.1:1",
            "--listen", "tcp://127.0.0.1:2"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--allowed-origins", value], environ={})
    assert "--allowed-origins" in capsys.readouterr().err


@pytest.mark.parametrize("origins", [["x" * 513], [""], ["*"] * 65, "*", [1]])
def test_router_config_bounds_the_cors_lists(tiny_llama_dir, origins):
    with pytest.raises(ValueError, match=r"allowed_origins \(--allowed-origins\) is"):
        RouterConfig(model_path=tiny_llama_dir, allowed_origins=origins)
