"""Draining one node through the router's admin routes (router/api/admin.py,
router/cluster/node_drain.py), in process: nodes are injected NodeStats, requests in flight are
entries of the node client's table, and the app is called through ASGI."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pdserve.bench.node_metrics import parse_metric
from pdserve.router.api.app import create_app
from pdserve.router.cluster.inflight import InFlight
from pdserve.wire.cluster_auth import ClusterAuth
from tests.node_stats import node_stats
from tests.router import unlooped

SECRET = "a cluster secret of the tests, long enough"


def stats(node_id: str, role: str, free: int = 10, running: int = 0):
    return node_stats(
        node_id=node_id, role=role, listen_address=f"tcp://127.0.0.1:{hash(node_id) % 999 + 3}",
        block_size=16, model_fingerprint="m", dtype="float32", num_free_blocks=free,
        num_total_blocks=10, num_running=running,
    )


def make_app(tokenizer, secret: str | None = SECRET, **settings):
    auth = ClusterAuth.from_secret(secret)
    config = unlooped.unlooped_router_config(
        Path("unused"), "tiny", cluster_auth=auth, **settings
    )
    app = create_app(config, tokenizer=tokenizer)
    client = app.state.router.client
    client.registry.nodes.clear()  # the configured address is not one of these nodes
    for node_id, free in (("d0", 9), ("d1", 5)):
        client.record_stats(stats(node_id, "decode", free))
    client.record_stats(stats("p0", "prefill"))
    return app, auth.admin_token()


def call(app, method: str, path: str, token: str | None = None, client=("127.0.0.1", 5000),
         **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def test_admin_routes_need_loopback_and_the_token_derived_from_the_cluster_secret(tokenizer):
    app, token = make_app(tokenizer, api_key="the-api-key")
    assert call(app, "GET", "/admin/nodes").status_code == 401
    assert call(app, "GET", "/admin/nodes", token="the-api-key").status_code == 401
    assert call(app, "GET", "/admin/nodes", token=token, client=("10.1.2.3", 1)).status_code == 403
    answer = call(app, "GET", "/admin/nodes", token=token)
    assert answer.status_code == 200  # the API key is not asked for
    assert {n["node_id"]: n["role"] for n in answer.json()["nodes"]} == {
        "d0": "decode", "d1": "decode", "p0": "prefill",
    }
    no_secret, _ = make_app(tokenizer, secret=None)
    assert call(no_secret, "GET", "/admin/nodes", token=token).status_code == 404


def test_a_draining_node_gets_no_new_request_and_is_empty_once_its_requests_end(tokenizer):
    app, token = make_app(tokenizer)
    client = app.state.router.client
    assert client.live_node().node_id == "d0"  # the most free blocks
    d0 = client.registry.find("d0")
    client.inflight.add("r1", InFlight(asyncio.Queue(), d0))
    drained = call(app, "POST", "/admin/nodes/d0/drain", token=token).json()
    assert drained["state"] == "draining" and drained["held"] == 1 and drained["live"]
    assert client.live_node().node_id == "d1"
    assert call(app, "DELETE", "/admin/nodes/d0", token=token).status_code == 409
    client.inflight.forget("r1")
    client.record_stats(stats("d0", "decode", 9, running=1))  # the node itself still runs one
    assert call(app, "POST", "/admin/nodes/d0/drain", token=token).json()["state"] == "draining"
    client.record_stats(stats("d0", "decode", 10))
    assert call(app, "POST", "/admin/nodes/d0/drain", token=token).json()["state"] == "empty"
    resumed = call(app, "POST", "/admin/nodes/d0/resume", token=token).json()
    assert resumed["state"] == "serving" and client.live_node().node_id == "d0"


def test_a_removed_node_leaves_the_registry_and_the_metrics(tokenizer):
    app, token = make_app(tokenizer)
    assert 'node="d0"' in call(app, "GET", "/metrics").text
    call(app, "POST", "/admin/nodes/d0/drain", token=token)
    assert call(app, "DELETE", "/admin/nodes/d0", token=token).json() == {"removed": "d0"}
    assert app.state.router.client.registry.find("d0") is None
    assert 'node="d0"' not in call(app, "GET", "/metrics").text
    assert call(app, "DELETE", "/admin/nodes/d0", token=token).status_code == 404
    # Its last NodeStats, read after the removal, does not bring it back.
    assert app.state.router.client.record_stats(stats("d0", "decode")) is None
    assert app.state.router.client.registry.find("d0") is None


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"from": "decode", "to": "prefill", "reason": "prefill_queue"}, 200),
        ({"from": "decode", "to": "router", "reason": "prefill_queue"}, 400),
        ({"from": "decode", "to": "prefill", "reason": "Not A Word"}, 400),
    ],
)
def test_a_role_change_reported_by_the_launcher_is_counted(tokenizer, body, status):
    app, token = make_app(tokenizer)
    assert call(app, "POST", "/admin/role-changes", token=token, json=body).status_code == status
    counted = parse_metric(
        call(app, "GET", "/metrics").text, "pdserve_planner_role_changes_total", "to"
    )
    assert counted == ({"prefill": 1.0} if status == 200 else {})
