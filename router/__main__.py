"""`python -m pdserve.router --model PATH --node tcp://... --listen tcp://... [--port 8000]`.

Runs the app on uvicorn with uvloop and prints one line, "pdserve router listening on
http://HOST:PORT", once the socket accepts connections (with `--port 0` it shows the port the
OS picked). SIGTERM drains (router/drain.py); SIGINT shuts down without draining.

Every flag is generated from RouterConfig's and LogSettings' fields (wire/config_flags.py).
`pdserve serve` starts the router with no flags: it hands the settings as data, JSON in
$PDSERVE_ROUTER_CONFIG, {"router": {RouterConfig field: value}, "log": {LogSettings field:
value}}, in field units (the chat template's text); flags given override it. The secrets come
in the environment alone, never on the command line or in that JSON: the cluster secret
(`--cluster-secret`, else $PDSERVE_CLUSTER_SECRET) and the API key (`--api-key`, else
$PDSERVE_API_KEY) are read here, once. Logging is set up here, once, for the whole process
(wire/log_format.py); uvicorn's loggers write through the same handler.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.router.app import create_app
from pdserve.router.config import CONFIG_ENV, RouterConfig
from pdserve.router.drain import DrainingServer
from pdserve.wire.config_flags import add_flags, build, from_environment, in_flag_terms
from pdserve.wire.log_format import LogSettings

# Connections: one idle between requests (or since it opened) is closed after
# KEEP_ALIVE_TIMEOUT_S; a request line and headers must all arrive within
# REQUEST_HEAD_TIMEOUT_S of the connection being ready for them, and be at most
# MAX_REQUEST_HEAD_BYTES (else 400); the body must all arrive within REQUEST_BODY_TIMEOUT_S
# of the head (1 MiB, the largest body, at 17 KB/s).
KEEP_ALIVE_TIMEOUT_S = 5
REQUEST_HEAD_TIMEOUT_S = 10.0
REQUEST_BODY_TIMEOUT_S = 60.0
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# The parts of $PDSERVE_ROUTER_CONFIG (router/config.py's CONFIG_ENV).
CONFIG_PARTS = ("router", "log")


class RequestDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and for its body, and
    the idle timeout from the start. uvicorn's keep-alive timer runs only after a response and
    restarts at every byte, so a connection that never sends anything, or a client that sends
    its request a byte a second (slow loris), would hold its connection forever.

    Here, from the moment a connection is ready for a request (it opened, or the previous
    request was read and answered), its whole head must arrive within `head_timeout_s`, and
    then its whole body within `body_timeout_s`, however they trickle in; else the connection
    is closed (a route reading the body sees its client gone)."""

    def __init__(
        self, *args: Any, head_timeout_s: float, body_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.timeouts_s = {"head": head_timeout_s, "body": body_timeout_s}
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # the part of a request the deadline runs for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._follow_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Starts the deadline of the part of a request the connection now waits for (h11:
        IDLE, the head; SEND_BODY, the body), keeps the one running for the same part, and
        stops it once the request has been read."""
        state = self.conn.their_state
        if self.transport.is_closing():
            awaiting = None
        elif state is h11.IDLE:
            awaiting = "head"
        elif state is h11.SEND_BODY:
            awaiting = "body"
        else:
            awaiting = None
        if awaiting != self._awaiting:
            self._set_deadline(awaiting)

    def _set_deadline(self, awaiting: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._awaiting = awaiting
        if awaiting is not None:
            timeout_s = self.timeouts_s[awaiting]
            self._deadline = self.loop.call_later(timeout_s, self._late, awaiting)

    def _late(self, awaiting: str) -> None:
        self._deadline = None
        if self._awaiting != awaiting or self.transport.is_closing():
            return
        host, port = self.client or ("?", 0)
        self.logger.info(
            "%s:%d sent no complete request %s within %g s; closing its connection",
            host,
            port,
            awaiting,
            self.timeouts_s[awaiting],
        )
        self.transport.close()


def uvicorn_config(
    app: Any,
    config: RouterConfig,
    log_level: str = "warning",  # uvicorn's own loggers
    keep_alive_timeout_s: float = KEEP_ALIVE_TIMEOUT_S,
    head_timeout_s: float = REQUEST_HEAD_TIMEOUT_S,
    body_timeout_s: float = REQUEST_BODY_TIMEOUT_S,
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        log_config=None,  # its loggers propagate to the process's handler (LogSettings)
        loop="uvloop",
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=functools.partial(
            RequestDeadlineH11Protocol,
            head_timeout_s=head_timeout_s,
            body_timeout_s=body_timeout_s,
        ),
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]  # seconds
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
    )


def launcher_config(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The settings `pdserve serve` handed this router as data ({} parts when none)."""
    text = environ.get(CONFIG_ENV)
    loaded = json.loads(text) if text else {}
    well_formed = isinstance(loaded, dict) and set(loaded) <= set(CONFIG_PARTS)
    if not well_formed or not all(isinstance(part, dict) for part in loaded.values()):
        raise ValueError(f"expected a JSON object of objects, keys among {list(CONFIG_PARTS)}")
    return {part: loaded.get(part, {}) for part in CONFIG_PARTS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.router", description=__doc__.split("\n")[0],
        epilog=f"${CONFIG_ENV} (JSON, from `pdserve serve`) gives settings these flags override.",
    )
    add_flags(parser, RouterConfig)
    add_flags(parser, LogSettings)
    return parser


def parse_args(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[RouterConfig, LogSettings]:
    """The router's settings: RouterConfig's defaults, then its secrets from `environ`
    (default: this process's), then `environ`'s launcher config, then the flags given."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        launched = launcher_config(environ)
    except ValueError as error:
        parser.error(f"${CONFIG_ENV}: {error}")
    try:
        base = {**from_environment(RouterConfig, environ), **launched["router"]}
        config = build(RouterConfig, args, base)
        log = build(LogSettings, args, launched["log"])
    except (ValueError, TypeError) as error:
        parser.error(in_flag_terms(RouterConfig, str(error)))
    return config, log


async def serve(config: RouterConfig, log: LogSettings) -> None:
    app = create_app(config)
    server = DrainingServer(
        uvicorn_config(app, config, log.uvicorn_level), app.state.router, config.drain_timeout_s
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # startup failed: surface its exception
            raise SystemExit(1)
        await asyncio.sleep(0.02)
    port = config.port
    for srv in server.servers:
        for sock in srv.sockets:
            port = sock.getsockname()[1]
            break
    # What startup built (the app, the tokenizer, the imported modules) lives as long as the
    # router: out of the collector's generations, each collection during a burst scans only
    # what requests allocated (a 1,000-request burst spent 0.24 s of 1.4 s CPU in collections).
    gc.collect()
    gc.freeze()
    print(f"pdserve router listening on http://{config.host}:{port}", flush=True)
    await task


def main(argv: list[str] | None = None) -> None:
    config, log = parse_args(argv)
    log.apply()
    import uvloop

    try:
        uvloop.run(serve(config, log))
    except KeyboardInterrupt:  # SIGINT: uvicorn has shut down and re-raised it
        pass
    logging.getLogger(__name__).info("router stopped")


if __name__ == "__main__":
    sys.exit(main())
