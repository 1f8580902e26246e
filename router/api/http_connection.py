"""The router's HTTP/1.1 connections: uvicorn's httptools protocol (llhttp, a C parser: about
a quarter of the CPU h11 spends on a refused request) with a deadline for each request's head
and for its body, a bound on the head's size, and the idle timeout from the start.

uvicorn's keep-alive timer runs only after a response and restarts at every byte, so a
connection that never sends anything, or a client that sends its request a byte a second (slow
loris), would hold its connection forever; and llhttp has no bound of its own on a head's size.

Lifecycle of a connection, by what it reads (`Reading`), each stage with its deadline:
  HEAD    from the moment the connection is ready for a request (it opened, or the previous
          request was read and answered): its request line and headers must all arrive within
          `head_timeout_s`, however they trickle in, and be at most `max_head_bytes` (else 400
          and the connection is closed)
  BODY    from the end of the head: the whole body must arrive within `body_timeout_s` (a route
          reading it then sees its client gone)
  ANSWER  the request is read and its response not yet complete: no deadline here (a stream
          may last minutes; the routes bound their own waits), then HEAD again
  REFUSED the head was enough to refuse the request (router/api/early_refusal.py): the answer
          is written as the head completes, before any ASGI task, and the connection closes;
          whatever else the client sent is dropped. Only a request with no answer still being
          written ahead of it is refused so (a pipelined one goes to the app).
A deadline that passes closes the connection.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.router.api.early_refusal import EarlyRefusal


class Reading(enum.Enum):
    HEAD = "head"
    BODY = "body"
    ANSWER = "answer"
    REFUSED = "refused"


class HeadTooLarge(Exception):
    """Raised from a parser callback: httptools turns it into the HttpParserError uvicorn
    answers with 400 and a closed connection."""


class RequestDeadlineProtocol(HttpToolsProtocol):
    def __init__(
        self,
        *args: Any,
        head_timeout_s: float,
        body_timeout_s: float,
        max_head_bytes: int,
        early_refusal: EarlyRefusal | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.early_refusal = early_refusal
        self.timeouts_s = {Reading.HEAD: head_timeout_s, Reading.BODY: body_timeout_s}
        self.max_head_bytes = max_head_bytes
        self.reading: Reading | None = None
        self.head_bytes_received = 0  # of the head being read, while it is incomplete
        self.head_bytes_parsed = 0  # its request target and headers, as the parser gives them
        self._deadline: asyncio.TimerHandle | None = None

    # -- the transport's events ------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._enter(Reading.HEAD)

    def data_received(self, data: bytes) -> None:
        if self.reading is Reading.HEAD:
            self.head_bytes_received += len(data)
        super().data_received(data)
        if self.reading is Reading.HEAD and self.head_bytes_received > self.max_head_bytes:
            self._refuse_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        super().connection_lost(exc)

    # -- the parser's and the response's events ---------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._enter(Reading.HEAD)  # a pipelined request: its head runs from its first byte

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused_early():
            return
        self._enter(Reading.BODY)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.reading is not Reading.REFUSED:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.reading is Reading.REFUSED:
            return
        self._enter(Reading.ANSWER)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.reading is Reading.ANSWER and not self.transport.is_closing():
            self._enter(Reading.HEAD)

    # -- stages -----------------------------------------------------------------------------

    def _enter(self, reading: Reading | None) -> None:
        """Moves to `reading`, starting its deadline; staying in a stage keeps its deadline."""
        if reading is self.reading:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.reading = reading
        if reading is Reading.HEAD:
            self.head_bytes_received = self.head_bytes_parsed = 0
        timeout_s = self.timeouts_s.get(reading) if reading is not None else None
        if timeout_s is not None:
            self._deadline = self.loop.call_later(timeout_s, self._expire, reading)

    def _expire(self, reading: Reading) -> None:
        self._deadline = None
        if self.reading is not reading or self.transport.is_closing():
            return
        host, port = self.client or ("?", 0)
        self.logger.info(
            "%s:%d sent no complete request %s within %g s; closing its connection",
            host,
            port,
            reading.value,
            self.timeouts_s[reading],
        )
        self.transport.close()

    def _refused_early(self) -> bool:
        """Writes the refusal and closes the connection where `early_refusal` refuses this
        request and no earlier answer on the connection is still being written."""
        answering = self.cycle is not None and not self.cycle.response_complete
        if self.early_refusal is None or answering:
            return False
        method = self.parser.get_method().decode("ascii")
        path = self.root_path + httptools.parse_url(self.url).path.decode("ascii")
        if "%" in path:
            return False  # an escaped path: the app decodes it and answers
        answer = self.early_refusal.answer(
            method, path, self.headers, self.server_state.default_headers
        )
        if answer is None:
            return False
        self._enter(Reading.REFUSED)
        self.transport.write(answer)
        self.transport.close()
        return True

    def _count_head(self, num_bytes: int) -> None:
        self.head_bytes_parsed += num_bytes
        if self.head_bytes_parsed > self.max_head_bytes:
            raise HeadTooLarge(f"the request head passed {self.max_head_bytes} bytes")

    def _refuse_head(self) -> None:
        if not self.transport.is_closing():
            self.logger.info("a request head passed %d bytes; answering 400", self.max_head_bytes)
            self.send_400_response("Request head too large.")
        self._enter(None)
