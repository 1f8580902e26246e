"""Reads a request body as a JSON object: 413 over the size limit, 400 for invalid UTF-8,
malformed JSON (NaN and Infinity included), anything but an object, or a string anywhere in it
(a value or a key, at any depth) holding an unpaired UTF-16 surrogate ("\\ud800" is valid JSON
but no Unicode text: no tokenizer, grammar compiler or msgpack encoder takes it), the 400
naming where. A client that goes away while sending it (or is cut off by the server's deadline
for a body, router/__main__.py) raises `ClientDisconnected`."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from pdserve.router.errors import APIError, ClientDisconnected, invalid

_SURROGATE = re.compile("[\ud800-\udfff]")


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
    check_unicode(data)
    return data


def check_unicode(body: dict[str, Any]) -> None:
    """400 naming the first string of `body` (value or key) with an unpaired surrogate."""
    pending: list[tuple[str, Any]] = [("", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            surrogate = _SURROGATE.search(value)
            if surrogate is not None:
                raise invalid(
                    f"'{path}' is not valid Unicode text: it holds an unpaired UTF-16 surrogate "
                    f"at character {surrogate.start():,}.",
                    path,
                )
        elif isinstance(value, dict):
            if any(_SURROGATE.search(key) for key in value):
                raise invalid(
                    f"A key of '{path or 'the request body'}' is not valid Unicode text: "
                    "it holds an unpaired UTF-16 surrogate.",
                    path or None,
                )
            pending += [
                (f"{path}.{key}" if path else key, item) for key, item in reversed(value.items())
            ]
        elif isinstance(value, list):
            pending += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
