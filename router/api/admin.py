"""The router's admin routes: what the launcher's run-time planner (commands/role_planner.py)
reads and asks, over loopback HTTP.

  GET    /admin/nodes                 every known node's signals (`NodeDrains.describe`) and
                                      the latencies of the choices finished lately
                                      (router/recent_latencies.py)
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
import time
from typing import Any

from fastapi import FastAPI, Request

from pdserve.router.api.auth import key_matches
from pdserve.router.api.body import read_json_object
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


async def list_nodes(request: Request) -> dict[str, Any]:
    state = authorize(request)
    drains = state.drains
    return {
        "nodes": [drains.describe(node) for node in state.client.nodes],
        "recent_choices": state.metrics.recent.describe(time.monotonic()),
    }


async def drain_node(request: Request, node_id: str) -> dict[str, Any]:
    drains = authorize(request).drains
    drains.drain(node_id)
    return drains.describe(drains.node(node_id))


async def resume_node(request: Request, node_id: str) -> dict[str, Any]:
    drains = authorize(request).drains
    drains.resume(node_id)
    return drains.describe(drains.node(node_id))


async def remove_node(request: Request, node_id: str) -> dict[str, Any]:
    authorize(request).drains.remove(node_id)
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
