"""Refusals the router's connections write themselves (router/api/early_refusal.py): on the
router's own uvicorn configuration a request the admission checks refuse gets the answer the
app would give (status, body, `Retry-After`, its `x-request-id`, counted and logged), written
as its head completes and with `connection: close`; a wrong API key is still a 401 first, on a
connection that stays open; a request that passes the checks is served."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.early_refusal import EarlyRefusal
from tests.router.fake_node import (
    MODEL,
    REPLY,
    FakeNode,
    admission_counts,
    completion_body,
    error_count,
    make_app,
    node_stats,
)
from tests.router.served import local_port, serving
from tests.router.unlooped import unlooped_router_config

KEY = "sk-early-refusal"


def test_a_refusal_is_written_by_the_connection_as_the_app_answers_it(
    tokenizer, tmp_path, caplog
):
    app = make_app(tokenizer, tmp_path, node_stats())
    app.state.router.config.max_queued_requests = 0
    through_app = TestClient(app).post("/v1/completions", json=completion_body(True))
    caplog.set_level(logging.INFO, logger="pdserve.router.api.access_log")
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        early = http.post(
            "/v1/completions", json=completion_body(True), headers={"x-request-id": "burst-7"}
        )
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert early.status_code == through_app.status_code == 429
    assert early.json() == through_app.json()
    for header in ("retry-after", "content-type", "content-length"):
        assert early.headers[header] == through_app.headers[header]
    assert early.headers["x-request-id"] == "burst-7"
    assert early.headers["connection"] == "close"  # the connection's answer, not the app's
    assert "connection" not in through_app.headers
    assert chat.status_code == 429 and chat.headers["connection"] == "close"
    assert error_count(app, through_app.json()["error"]["type"]) == 3
    lines = [r.getMessage() for r in caplog.records if "request_id=burst-7" in r.getMessage()]
    assert len(lines) == 1 and "status=429" in lines[0] and "route=/v1/completions" in lines[0]
    assert admission_counts(app) == (0, 0)


def test_a_wrong_api_key_is_a_401_before_any_429(tokenizer, tmp_path):
    config = unlooped_router_config(Path("unused"), MODEL, node_timeout_s=30.0, api_key=KEY)
    app = create_app(config, tokenizer=tokenizer)
    app.state.router.client.record_stats(node_stats())
    config.max_queued_requests = 0
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        stranger = http.post("/v1/completions", json=completion_body(False))
        again = http.post("/v1/completions", json=completion_body(False))
        ports = {local_port(stranger), local_port(again)}
        keyed = http.post(
            "/v1/completions",
            json=completion_body(False),
            headers={"authorization": f"Bearer {KEY}"},
        )
    assert stranger.status_code == again.status_code == 401
    assert len(ports) == 1  # the app answered: the connection stayed open
    assert keyed.status_code == 429 and keyed.headers["connection"] == "close"


def test_a_request_with_room_is_served_on_a_connection_that_stays_open(tokenizer, tmp_path):
    app = make_app(tokenizer, tmp_path)
    node = FakeNode(tokenizer).install(app)
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        app.state.router.client.record_stats(node_stats())
        first = http.post("/v1/completions", json=completion_body(False))
        second = http.post("/v1/completions", json=completion_body(False))
        ports = {local_port(first), local_port(second)}
    assert [r.status_code for r in (first, second)] == [200, 200]
    assert first.json()["choices"][0]["text"] == REPLY
    assert len(ports) == 1
    assert len(node.submitted) == 2
    assert admission_counts(app) == (0, 0)


def test_the_early_refusal_reads_the_route_less_the_root_path_and_the_keys_rule(tokenizer):
    config = unlooped_router_config(
        Path("unused"), MODEL, node_timeout_s=30.0, api_key=KEY, root_path="/llm"
    )
    app = create_app(config, tokenizer=tokenizer)
    app.state.router.client.record_stats(node_stats())
    config.max_queued_requests = 0
    refusal = EarlyRefusal(app.state.router)
    keyed = [(b"authorization", f"Bearer {KEY}".encode())]
    answer = refusal.answer("POST", "/llm/v1/completions", keyed)
    assert answer is not None and answer.startswith(b"HTTP/1.1 429")
    assert refusal.answer("POST", "/llm/v1/completions", []) is None  # the app's 401 first
    assert refusal.answer("POST", "/llm/tokenize", []).startswith(b"HTTP/1.1 429")  # no key
    # A browser's request goes to the app, whose answer carries the CORS headers.
    assert refusal.answer("POST", "/llm/v1/completions", [*keyed, (b"origin", b"https://a")]) is None


def test_a_browsers_refusal_through_the_app_carries_the_cors_headers(tokenizer, tmp_path):
    app = make_app(tokenizer, tmp_path, node_stats())
    app.state.router.config.max_queued_requests = 0
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        refused = http.post(
            "/v1/completions", json=completion_body(False), headers={"origin": "https://a.example"}
        )
    assert refused.status_code == 429
    assert refused.headers["access-control-allow-origin"] == "*"
    assert "connection" not in refused.headers  # the app answered, not the connection
