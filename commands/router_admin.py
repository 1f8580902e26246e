"""The launcher's client for the router's admin routes (router/api/admin.py): the run-time
planner's only way to read the router's signals and to drain, resume and remove a node.

Plain HTTP to the router's own port on the loopback address, with the bearer token derived
from the deployment's cluster secret (`ClusterAuth.admin_token`, wire/cluster_auth.py); every
call is bounded by `timeout_s` and raises `RouterAdminError` for any failure (the router busy,
restarting, or answering an error), which the caller treats as "try again later".
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pdserve.commands.role_planner import ClusterSignals, NodeSignals, RecentChoice

TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 1 << 20


class RouterAdminError(RuntimeError):
    pass


def admin_url(host: str, port: int, scheme: str = "http") -> str:
    """The router's HTTP address as the launcher reaches it on this host; ValueError when the
    router listens on an address that is neither a wildcard nor a loopback one (the admin
    routes answer loopback clients only)."""
    if host in ("0.0.0.0", "127.0.0.1", "localhost") or host.startswith("127."):
        return f"{scheme}://127.0.0.1:{port}"
    if host in ("::", "::1"):
        return f"{scheme}://[::1]:{port}"
    raise ValueError(
        f"--planner needs the router on a loopback or wildcard --host (it calls the router's "
        f"admin routes from this host's loopback address); --host is {host}"
    )


class RouterAdmin:
    def __init__(
        self,
        url: str,
        token: str,
        timeout_s: float = TIMEOUT_S,
        tls_context: ssl.SSLContext | None = None,  # an https router (commands/router_tls.py)
    ) -> None:
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.tls_context = tls_context

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout_s, context=self.tls_context
            ) as response:
                return json.loads(response.read(MAX_ANSWER_BYTES))
        except urllib.error.HTTPError as error:
            detail = error.read(2000).decode(errors="replace")
            raise RouterAdminError(f"{method} {path}: {error.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise RouterAdminError(f"{method} {path}: {error}") from None

    @staticmethod
    def _node_path(node_id: str) -> str:
        return f"/admin/nodes/{urllib.parse.quote(node_id, safe='')}"

    def signals(self, now: float) -> ClusterSignals:
        answer = self._call("GET", "/admin/nodes")
        try:
            nodes = tuple(NodeSignals.from_json(e) for e in answer["nodes"])
            recent = tuple(RecentChoice.from_json(e) for e in answer.get("recent_choices", ()))
            return ClusterSignals(now, nodes, recent)
        except (KeyError, TypeError, ValueError) as error:
            raise RouterAdminError(f"GET /admin/nodes: {error}") from None

    def drain(self, node_id: str) -> NodeSignals:
        return self._node(f"{self._node_path(node_id)}/drain")

    def resume(self, node_id: str) -> NodeSignals:
        return self._node(f"{self._node_path(node_id)}/resume")

    def _node(self, path: str) -> NodeSignals:
        try:
            return NodeSignals.from_json(self._call("POST", path))
        except ValueError as error:
            raise RouterAdminError(f"POST {path}: {error}") from None

    def remove(self, node_id: str) -> None:
        self._call("DELETE", self._node_path(node_id))

    def record_change(self, from_role: str, to_role: str, reason: str) -> None:
        body = {"from": from_role, "to": to_role, "reason": reason}
        self._call("POST", "/admin/role-changes", body)
