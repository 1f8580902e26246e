"""Server-sent events as OpenAI streams them, and a streaming response that always closes
its generator (so the generator's `finally` aborts the node requests) when the client goes
away, whichever ASGI spec version the server speaks."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, media_type=self.media_type, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
