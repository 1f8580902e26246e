"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a status.

Any part of the router raises `APIError` (the HTTP surface and the cluster client alike, for
example the admission queue's 429); router/api/error_handling.py answers it over HTTP. Nothing
here imports a web framework.
"""

from __future__ import annotations

from typing import Any

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


class ClientDisconnected(Exception):
    """The client went away while its request was being read or run."""


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
