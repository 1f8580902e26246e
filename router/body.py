"""Reads a request body as a JSON object: 413 over the size limit, 400 for invalid UTF-8,
malformed JSON (NaN and Infinity included) or anything but an object. A client that goes away
while sending it (or is cut off by the server's deadline for a body, router/__main__.py)
raises `ClientDisconnected`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from pdserve.router.errors import APIError, ClientDisconnected, invalid


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    too_large = APIError(413, f"The request body exceeds the limit of {max_bytes} bytes.")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected from None
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("The request body is not valid UTF-8.") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise invalid("The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.")
    return data
