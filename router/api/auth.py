"""API-key check as a pure ASGI middleware (no BaseHTTPMiddleware, which would get in the way
of streaming and disconnect detection). Every route but /health needs the key (load
balancers probe /health without credentials), and but the admin routes under /admin/, which
need the cluster's admin token instead (router/api/admin.py). Keys are compared in constant
time."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.api.error_handling import error_response
from pdserve.router.errors import APIError

OPEN_PATHS = frozenset({"/health"})
ADMIN_PREFIX = "/admin/"  # checked by router/api/admin.py


def key_matches(authorization: str, api_key: str) -> bool:
    scheme, _, token = authorization.strip().partition(" ")
    ok = hmac.compare_digest(token.strip().encode(), api_key.encode())
    return scheme.lower() == "bearer" and ok


class APIKeyMiddleware:
    def __init__(
        self, app: ASGIApp, api_key: str | None, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.api_key
            and scope["type"] == "http"
            and scope.get("path", "") not in OPEN_PATHS
            and not scope.get("path", "").startswith(ADMIN_PREFIX)
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
