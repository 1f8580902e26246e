"""OpenAI-shaped errors over HTTP.

`install_error_handlers` answers `APIError` (router/errors.py), FastAPI's request validation
errors (always 400, never 422, never echoing the input) and Starlette's HTTP errors in that
shape. `RequestGuard` (the outermost of the app's middleware) answers everything else, and
runs each request's end-of-request callbacks (`at_request_end`) once, whatever happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.errors import APIError, ClientDisconnected, validation_error

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away; nobody reads it
REQUEST_END_SCOPE_KEY = "pdserve.request_end"


def error_headers(error: APIError) -> dict[str, str]:
    """`WWW-Authenticate` on a 401 and `Retry-After` on a 429 and a 503 (no node can serve yet,
    or the server is draining)."""
    if error.status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if error.status in (429, 503):
        return {"Retry-After": str(RETRY_AFTER_S)}
    return {}


def error_response(error: APIError) -> JSONResponse:
    """`error` as the client sees it: its OpenAI body and status, with `error_headers`."""
    return JSONResponse(error.body(), status_code=error.status, headers=error_headers(error))


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Registers the handlers; `on_error(kind)` (optional) counts each error answered."""

    def count(kind: str) -> None:
        if on_error is not None:
            on_error(kind)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        count(error.type)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        api_error = validation_error(list(error.errors()))
        count(api_error.type)
        return error_response(api_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        api_error = APIError(error.status_code, str(error.detail))
        count(api_error.type)
        return error_response(api_error)


def at_request_end(scope: Scope, callback: Callable[[], None]) -> None:
    """Runs `callback()` (which must not block) when the request is over: its response sent,
    its client gone, or its route failed. Needs the app's `RequestGuard`."""
    callbacks = scope.get(REQUEST_END_SCOPE_KEY)
    if callbacks is None:
        raise RuntimeError("at_request_end() needs the app to run behind RequestGuard")
    callbacks.append(callback)


class RequestGuard:
    """Pure ASGI middleware, the outermost of the app's own, around every HTTP request.

    - An exception that escapes the route (a bug, a library error) is answered with an
      OpenAI-shaped 500 and the request ends normally: an exception that reached the server
      would make it close the connection, failing the client's next request on it.
    - A client that went away (Starlette's ClientDisconnect while the body is read, or
      `ClientDisconnected` while the request ran) is counted as `client_disconnected`, with
      no traceback; it gets a bodiless 499 if it is still there to read one.
    - The callbacks registered with `at_request_end` run once, in this guard's `finally`, in
      reverse order: whatever a request holds (admission slots, node sub-requests) is given
      back there, however the request ended (a streamed response included).
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    def _count(self, kind: str) -> None:
        if self.on_error is not None:
            self.on_error(kind)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        callbacks: list[Callable[[], None]] = []
        scope = {**scope, REQUEST_END_SCOPE_KEY: callbacks}
        response_started = False

        async def send_tracked(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except (ClientDisconnect, ClientDisconnected):
            self._count("client_disconnected")
            if not response_started:
                await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
        except Exception as error:
            self._count("server_error")
            if response_started:  # too late for a status: the server ends the connection
                raise
            logger.exception(
                "%s %s failed: %s", scope.get("method"), scope.get("path"), type(error).__name__
            )
            await error_response(APIError(500, "internal server error"))(scope, receive, send)
        finally:
            for callback in reversed(callbacks):
                try:
                    callback()
                except Exception:
                    logger.exception("end-of-request callback %r failed", callback)
