"""Graceful drain of the router on SIGTERM.

SIGTERM: the router stops taking work (every new generation request, and /health, answers 503
so a load balancer moves away) and keeps serving the requests in flight until none is left or
`drain_timeout_s` has passed; the ones still running then end with a 503: an error event for a
stream that has started, the HTTP status otherwise. Then uvicorn shuts down as usual (closes
the listener, lets the responses finish within its graceful timeout). A second SIGTERM, or
SIGINT, skips the drain: uvicorn's own shutdown starts at once. A second SIGINT forces the exit
(connections are not waited for), and the app's shutdown still closes the node links.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_MESSAGE = "The server is shutting down; the request did not finish in time."


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains `state` (the app's RouterState)."""

    def __init__(self, config: uvicorn.Config, state: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: plain assignments only (no logging, no locks).
        if sig == signal.SIGTERM and self.drain_deadline is None and not self.should_exit:
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            self.state.draining = True
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown; after a forced exit (a second SIGINT) the app's own shutdown
        still runs (it closes the node links at once), so no task is left for the event loop to
        cancel with a traceback."""
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            self._drain_step()
        return await super().on_tick(counter)

    def _drain_step(self) -> None:
        inflight = self.state.client.inflight
        if not self._announced:
            self._announced = True
            logger.warning(
                "SIGTERM: draining %d requests in flight (at most %.0f s); new requests get 503",
                len(inflight),
                self.drain_timeout_s,
            )
        if not inflight:
            logger.warning("drained: no request in flight; shutting down")
            self.should_exit = True
        elif time.monotonic() >= self.drain_deadline:
            logger.warning("drain timeout: ending %d requests with a 503", len(inflight))
            self.state.client.fail_all(DRAIN_TIMEOUT_MESSAGE)
            self.should_exit = True
