"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a status.

Route code raises `APIError`; `install_error_handlers` maps it, FastAPI's request validation
errors (always 400, never 422, never echoing the input), Starlette's HTTP errors and anything
unexpected (500) to that shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = kind or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status == 429:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 from pydantic errors: names the parameter and the rule, never the input."""
    first = errors[0] if errors else {}
    param = param_from_loc(first.get("loc", ()))
    message = first.get("msg", "invalid request")
    return APIError(400, f"Invalid value for '{param}': {message}" if param else message, param)


def param_from_loc(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """`('messages', 0, 'role')` -> `messages[0].role`; drops FastAPI's 'body' prefix and the
    tags pydantic adds for union members (e.g. 'str', 'list[int]')."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Registers the handlers; `on_error(kind)` (optional) counts each error answered."""

    def count(kind: str) -> None:
        if on_error is not None:
            on_error(kind)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        count(error.type)
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        api_error = validation_error(list(error.errors()))
        count(api_error.type)
        return api_error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        api_error = APIError(error.status_code, str(error.detail))
        count(api_error.type)
        return api_error.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", type(error).__name__)
        count("server_error")
        return APIError(500, "internal server error").response()
