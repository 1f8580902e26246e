"""Server-sent events as OpenAI streams them, and a streaming response that always closes
its generator (so the generator's `finally` aborts the node requests) when the client goes
away, whichever ASGI spec version the server speaks.

A client that stops reading is gone too: the server's transport buffers a bounded amount
(uvicorn pauses the app's writes past its high-water mark), so a write that stays blocked for
`stall_timeout_s` ends the response the same way, after `on_stall()`; the server then closes
the connection."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        content: Any,
        stall_timeout_s: float | None = None,
        on_stall: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, media_type=self.media_type, **kwargs)
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self._sends_pending = 0

    def write_blocked(self) -> bool:
        """Whether a write to the client is waiting (the server paused the app's writes
        because the client reads slower than they come)."""
        return self._sends_pending > 0

    def _guarded(self, send: Send) -> Send:
        async def send_or_stall(message: Any) -> None:
            self._sends_pending += 1
            try:
                if self.stall_timeout_s is None:
                    await send(message)
                    return
                with anyio.fail_after(self.stall_timeout_s):
                    await send(message)
            finally:
                self._sends_pending -= 1

        return send_or_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(self._guarded(send))
                    except TimeoutError:  # before OSError, which it subclasses
                        if self.on_stall is not None:
                            self.on_stall()
                    except OSError:
                        pass
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
