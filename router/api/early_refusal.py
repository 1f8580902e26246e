"""A refusal written by the connection itself: the 429 (or 503) that `OverloadChecks` gives a
request, answered the moment its head is parsed, as bytes on the transport.

Under a 1,000-request burst most requests are refused; through the app each refusal is an
ASGI task, the middleware chain and a response object, and on a host whose cores are busy that
cost, paid by the one router process, is what delays the last refusal. Here a refusal is the
checks, one access line and one write.

What the client sees is what the app would have answered (router/api/overload_gate.py): the
same status, OpenAI error body and headers (`Retry-After`), its `x-request-id`, the server's
default headers, counted in `pdserve_request_errors_total` and logged as an access line, plus
`connection: close`: the request's body is never read, and the client reconnects when it
retries. The connection leaves to the app (`answer` returns None) every request it cannot
answer alike: one whose path no check guards, one that passes the checks, one whose API key
must be checked first (a wrong key is a 401 before any 429: router/api/auth.py), and one from a
browser (an `Origin` header) while CORS is on, whose answer needs the CORS headers the app adds.
Paths are matched less the root path (router/api/route_path.py).
"""

from __future__ import annotations

import http
import json
import time
from collections.abc import Callable, Iterable

from pdserve.router.api.access_log import RequestRecord, access_fields, log_access, request_id_from
from pdserve.router.api.auth import key_matches, key_required
from pdserve.router.api.error_handling import error_headers
from pdserve.router.api.overload_gate import OverloadChecks
from pdserve.router.api.route_path import without_root_path
from pdserve.router.errors import APIError
from pdserve.router.state import RouterState

Headers = Iterable[tuple[bytes, bytes]]


class EarlyRefusal:
    def __init__(self, state: RouterState, clock: Callable[[], float] = time.monotonic) -> None:
        self.checks = OverloadChecks(state)
        self.api_key = state.config.api_key
        self.key_on_every_route = state.config.api_key_guards_every_route
        self.root_path = state.config.root_path
        self.cors = bool(state.config.allowed_origins)
        self.log_requests = state.config.log_requests
        self.on_error = state.metrics.error
        self.clock = clock

    def answer(
        self, method: str, path: str, headers: Headers, default_headers: Headers = ()
    ) -> bytes | None:
        """The whole HTTP response refusing this request now, or None: the app answers it."""
        route = without_root_path(path, self.root_path)
        if not self.checks.guards(method, route):
            return None
        headers = list(headers)
        if self.cors and _header(headers, b"origin"):
            return None
        if (
            self.api_key
            and key_required(method, route, self.key_on_every_route)
            and not key_matches(_header(headers, b"authorization"), self.api_key)
        ):
            return None
        arrived_at = self.clock()
        error = self.checks.refusal(method, route)
        if error is None:
            return None
        self.on_error(error.type)
        request_id = request_id_from(headers)
        if self.log_requests:
            record = RequestRecord(request_id, arrived_at)
            log_access(access_fields(record, method, path, error.status, self.clock()))
        return _response(error, request_id, default_headers)


def _header(headers: Headers, name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _response(error: APIError, request_id: str, default_headers: Headers) -> bytes:
    """As starlette's JSONResponse renders the body, so both refusals read alike."""
    body = json.dumps(
        error.body(), ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")
    status = http.HTTPStatus(error.status)
    lines = [f"HTTP/1.1 {status.value} {status.phrase}".encode("ascii")]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode("ascii"),
    ]
    lines += [f"{name.lower()}: {value}".encode("latin-1") for name, value in error_headers(error).items()]
    lines += [b"x-request-id: " + request_id.encode("ascii"), b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
