"""The request id, and one access line per HTTP request (INFO, logger `pdserve.router.api.access_log`).

`AccessLog` is the app's outermost middleware. The request id is the client's `x-request-id`
header when it is 1 to 128 characters of `A-Z a-z 0-9 . _ : @ / + = -`; anything else (absent,
longer, other characters) is replaced by a new id (`uuid4().hex`) and never echoed. Every
response answers it in its `x-request-id` header, and the router's log lines about the request
name it; the OpenAI `id` of a completion stays the router's own (`cmpl-...`), given in the line
as `response_id`.

The line is written when the response has been sent (a stream: after `data: [DONE]`), however
the request ended. Fields: request_id, method, route, status (499: the client went away before
any answer), e2e_s (from the request's arrival at the router), and for a request that ran a
generation: response_id, prompt_tokens, generation_tokens, cached_tokens, ttft_s (arrival to
the first token of any choice; absent without one) and finish_reasons (the choices' distinct
reasons, in choice order; `abort` for a choice cut short). `/health`, `/ping` and `/metrics` (probes and
scrapes) get no line; `--disable-log-requests` turns every line off, not the header.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.api.error_handling import CLIENT_CLOSED_REQUEST
from pdserve.router.api.route_path import route_path

if TYPE_CHECKING:
    from pdserve.router.generation import Generation

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
REQUEST_RECORD_SCOPE_KEY = "pdserve.request_record"
UNLOGGED_PATHS = frozenset({"/health", "/ping", "/metrics"})
MAX_LOGGED_PATH_CHARS = 200


@dataclass
class RequestRecord:
    """What the access line reports of one request; a route that runs a generation sets
    `generation` (router/api/routes.py)."""

    request_id: str
    arrived_at: float
    generation: Generation | None = None


def request_id_from(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's `x-request-id` if it is a valid one, else a new id."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if VALID_REQUEST_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


def request_record(scope: Scope) -> RequestRecord | None:
    """The record `AccessLog` keeps for this request (None without the middleware)."""
    return scope.get(REQUEST_RECORD_SCOPE_KEY)


def access_fields(
    record: RequestRecord, method: str, path: str, status: int | None, now: float
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "method": method,
        "route": path[:MAX_LOGGED_PATH_CHARS].encode("unicode_escape").decode("ascii"),
        "status": CLIENT_CLOSED_REQUEST if status is None else status,
    }
    generation = record.generation
    if generation is not None:
        fields["response_id"] = generation.request_id
        fields["prompt_tokens"] = generation.prompt_tokens
        fields["generation_tokens"] = generation.completion_tokens
        fields["cached_tokens"] = generation.cached_tokens
        first_token_at = generation.first_token_at
        if first_token_at is not None:
            fields["ttft_s"] = round(first_token_at - record.arrived_at, 6)
        fields["finish_reasons"] = generation.finish_reasons
    fields["e2e_s"] = round(now - record.arrived_at, 6)
    return fields


def access_line(fields: dict[str, Any]) -> str:
    """`key=value` pairs; lists joined with commas."""
    parts = []
    for key, value in fields.items():
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        parts.append(f"{key}={text or '-'}")
    return " ".join(parts)


def log_access(fields: dict[str, Any]) -> None:
    logger.info("%s", access_line(fields), extra={"fields": fields})


class AccessLog:
    """Pure ASGI middleware, outside `error_handling.RequestGuard` so it sees the status that guard
    answers too."""

    def __init__(
        self, app: ASGIApp, enabled: bool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.app = app
        self.enabled = enabled
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id_from(scope.get("headers", ())), self.clock())
        scope = {**scope, REQUEST_RECORD_SCOPE_KEY: record}
        id_header = (REQUEST_ID_HEADER, record.request_id.encode("ascii"))
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            if self.enabled and route_path(scope) not in UNLOGGED_PATHS:
                log_access(
                    access_fields(record, scope.get("method", ""), path, status, self.clock())
                )
