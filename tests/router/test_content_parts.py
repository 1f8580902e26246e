"""A chat content part that is not text (router/api/content_parts.py) is a 400 that says this
server serves text-only models and names the part, not pydantic's type error."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from tests.router.unlooped import node_stats, unlooped_router_config

MODEL = "tiny"
MEDIA_PARTS = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://v.example/v.mp4"}},
    {"type": "file", "file": {"file_id": "file-1"}},
]


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tokenizer):
    app = create_app(unlooped_router_config(tiny_llama_dir, MODEL), tokenizer=tokenizer)
    app.state.router.client.record_stats(node_stats())
    return TestClient(app)


@pytest.mark.parametrize("part", MEDIA_PARTS, ids=lambda part: part["type"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_media_part_is_refused_naming_its_type_and_place(client, part, route):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]},
    ]
    response = client.post(route, json={"model": MODEL, "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].content[1].type"
    assert "text-only" in error["message"] and f"'{part['type']}'" in error["message"]
    assert "valid string" not in error["message"]


def test_text_parts_still_pass_and_an_unknown_part_type_is_the_schemas_error(client):
    text = [{"type": "text", "text": "hi"}]
    ok = client.post("/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": text}]})
    assert ok.status_code == 200, ok.text
    odd = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "sparkles"}]}]})
    assert odd.status_code == 400
    assert odd.json()["error"]["param"].startswith("messages[0].content")
