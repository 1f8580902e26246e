"""API-key check as a pure ASGI middleware (no BaseHTTPMiddleware, which would get in the way
of streaming and disconnect detection). Keys are compared in constant time.

Which routes need the key (`key_required`): as vLLM, the paths starting with /v1 only, so
/health, /ping, /version, /metrics, /tokenize and /detokenize stay open (Prometheus and load
balancers scrape and probe without credentials). With `--api-key-guards-every-route` every
route needs it but the liveness probes /health and /ping. The admin routes under /admin/ need
the cluster's admin token instead (router/api/admin.py). An OPTIONS request never needs it: a
browser's CORS preflight carries no credentials (router/api/app.py answers it before this
check; vLLM lets OPTIONS through too).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.api.error_handling import error_response
from pdserve.router.api.route_path import route_path
from pdserve.router.errors import APIError

OPENAI_PREFIX = "/v1"  # as vLLM's check: any path that starts with it
PROBE_PATHS = frozenset({"/health", "/ping"})
ADMIN_PREFIX = "/admin/"  # checked by router/api/admin.py


def key_matches(authorization: str, api_key: str) -> bool:
    scheme, _, token = authorization.strip().partition(" ")
    ok = hmac.compare_digest(token.strip().encode(), api_key.encode())
    return scheme.lower() == "bearer" and ok


def key_required(method: str, path: str, every_route: bool) -> bool:
    """Whether a request to `path` (less the root path) must carry the API key."""
    if method == "OPTIONS" or path.startswith(ADMIN_PREFIX):
        return False
    if every_route:
        return path not in PROBE_PATHS
    return path.startswith(OPENAI_PREFIX)


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        every_route: bool = False,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.every_route = every_route
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.api_key
            and scope["type"] == "http"
            and key_required(scope.get("method", ""), route_path(scope), self.every_route)
        ):
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not key_matches(authorization, self.api_key):
                error = APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
                if self.on_error is not None:
                    self.on_error(error.type)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
