"""The router's admin routes: what the launcher's run-time planner (commands/role_planner.py)
reads and asks, over loopback HTTP.

  GET    /admin/nodes                 every known node's signals (`node_signals`)
  POST   /admin/nodes/{id}/drain      stop placing new requests on it (router/cluster/node_drain.py)
  POST   /admin/nodes/{id}/resume     place requests on it again
  DELETE /admin/nodes/{id}            forget an empty, drained node whose process was stopped
                                      (409 while it holds requests)
  POST   /admin/role-changes          {"from": ROLE, "to": ROLE, "reason": WORD}: counts one
                                      role change (`pdserve_planner_role_changes_total`)

Every admin request must come from a loopback address (403 otherwise) and carry
`Authorization: Bearer <token>`, the token derived from the cluster secret
(`ClusterAuth.admin_token`, wire/cluster_auth.py; 401 otherwise). A router started without a
cluster secret has no admin routes (404). The API key does not open them
(router/api/auth.py leaves /admin/ to this check).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from fastapi import FastAPI, Request

from pdserve.router.api.auth import key_matches
from pdserve.router.api.body import read_json_object
from pdserve.router.cluster.node_drain import NodeNotEmpty, NodeNotFound
from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.errors import APIError, invalid
from pdserve.router.state import RouterState
from pdserve.wire.roles import Role

MAX_ADMIN_BODY_BYTES = 1024
REASON_PATTERN = re.compile(r"[a-z][a-z_]{0,31}")


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorize(request: Request) -> RouterState:
    """The router's state, for a request that may use the admin routes; APIError otherwise."""
    state: RouterState = request.app.state.router
    token = state.admin_token
    if token is None:
        raise APIError(404, "The admin routes need a cluster secret; this router has none.")
    if not _is_loopback(request.client.host if request.client else None):
        raise APIError(403, "The admin routes answer loopback clients only.")
    authorization = request.headers.get("authorization", "")
    if not key_matches(authorization, token):
        raise APIError(401, "Incorrect or missing admin token.", code="invalid_admin_token")
    return state


def node_signals(state: RouterState, node: NodeState, now: float) -> dict[str, Any]:
    """What the planner reads of one node: role, liveness, drain state, the requests the
    router has on it, the node's own queue and KV blocks, and the predicted queue delay of a
    prompt it would compute (router/cluster/queue_delay.py; 0 when its queue is empty)."""
    stats = node.stats
    delay = state.client.prompt_queues.delay(node, 0, now)
    timeout_s = state.client.registry.node_timeout_s
    live = not node.connection_lost and (node.up or node.alive(now, timeout_s))
    return {
        "node_id": node.node_id,
        "role": node.role,
        "address": node.address,
        "live": live,
        "state": state.drains.state(node).value,
        "held": state.drains.held(node),
        "num_waiting": stats.scheduling.num_waiting if stats else 0,
        "num_running": stats.scheduling.num_running if stats else 0,
        "kv_free_blocks": stats.kv.num_free_blocks if stats else 0,
        "kv_total_blocks": stats.kv.num_total_blocks if stats else 0,
        "queue_delay_s": delay.seconds if delay is not None else 0.0,
    }


async def list_nodes(request: Request) -> dict[str, Any]:
    state = authorize(request)
    now = state.client.clock()
    return {"nodes": [node_signals(state, node, now) for node in state.client.nodes]}


def _node_answer(state: RouterState, node_id: str) -> dict[str, Any]:
    return node_signals(state, state.drains.node(node_id), state.client.clock())


async def drain_node(request: Request, node_id: str) -> dict[str, Any]:
    state = authorize(request)
    try:
        state.drains.drain(node_id)
        return _node_answer(state, node_id)
    except NodeNotFound as error:
        raise APIError(404, str(error)) from None


async def resume_node(request: Request, node_id: str) -> dict[str, Any]:
    state = authorize(request)
    try:
        state.drains.resume(node_id)
        return _node_answer(state, node_id)
    except NodeNotFound as error:
        raise APIError(404, str(error)) from None


async def remove_node(request: Request, node_id: str) -> dict[str, Any]:
    state = authorize(request)
    try:
        state.drains.remove(node_id)
    except NodeNotFound as error:
        raise APIError(404, str(error)) from None
    except NodeNotEmpty as error:
        raise APIError(409, str(error)) from None
    return {"removed": node_id}


async def record_role_change(request: Request) -> dict[str, Any]:
    state = authorize(request)
    body = await read_json_object(request, MAX_ADMIN_BODY_BYTES)
    roles = {role.value for role in Role}
    for field in ("from", "to"):
        if body.get(field) not in roles:
            raise invalid(f"'{field}' must be one of {sorted(roles)}", field)
    reason = body.get("reason")
    if not isinstance(reason, str) or not REASON_PATTERN.fullmatch(reason):
        raise invalid("'reason' must be a lower-case word of at most 32 characters", "reason")
    state.metrics.role_change(body["from"], body["to"], reason)
    return {"counted": True}


def add_admin_routes(app: FastAPI) -> None:
    app.add_api_route("/admin/nodes", list_nodes, methods=["GET"])
    app.add_api_route("/admin/nodes/{node_id}/drain", drain_node, methods=["POST"])
    app.add_api_route("/admin/nodes/{node_id}/resume", resume_node, methods=["POST"])
    app.add_api_route("/admin/nodes/{node_id}", remove_node, methods=["DELETE"])
    app.add_api_route("/admin/role-changes", record_role_change, methods=["POST"])
