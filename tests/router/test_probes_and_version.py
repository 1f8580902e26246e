"""`GET /version`, and `/ping` (vLLM's and SageMaker's probe) answering as `/health` does."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.wire.package_version import package_version, pyproject_version
from tests.router.unlooped import node_stats, unlooped_router_config


@pytest.fixture(scope="module")
def app(tiny_llama_dir, tokenizer):
    return create_app(unlooped_router_config(tiny_llama_dir, "tiny"), tokenizer=tokenizer)


def test_version_answers_the_packages_version(app):
    response = TestClient(app).get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": package_version()}
    assert package_version() not in ("", "unknown")


def test_the_version_falls_back_to_pyprojects(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nversion = "9.8.7"\n')
    assert pyproject_version(pyproject) == "9.8.7"
    assert pyproject_version(tmp_path / "absent.toml") == "unknown"
    pyproject.write_text("not toml [")
    assert pyproject_version(pyproject) == "unknown"


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_503_without_a_node_and_200_with_one_as_health(app, method):
    client = TestClient(app)
    app.state.router.client.nodes[0].stats = None
    assert client.request(method, "/ping").status_code == 503
    assert client.get("/health").status_code == 503
    app.state.router.client.record_stats(node_stats())
    try:
        assert client.request(method, "/ping").json() == {"status": "ok"}
        assert client.get("/health").json() == {"status": "ok"}
    finally:
        app.state.router.client.nodes[0].stats = None


def test_ping_is_503_while_the_router_drains(app):
    client = TestClient(app)
    app.state.router.client.record_stats(node_stats())
    app.state.router.draining = True
    try:
        assert client.get("/ping").status_code == 503
    finally:
        app.state.router.draining = False
        app.state.router.client.nodes[0].stats = None
