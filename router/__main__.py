"""`python -m router --model PATH --node tcp://... --listen tcp://... [--port 8000]`.

Runs the app on uvicorn with uvloop and prints one line, "pdserve router listening on
http://HOST:PORT", once the socket accepts connections (with `--port 0` it shows the port the
OS picked). SIGTERM drains (router/drain.py); SIGINT shuts down without draining. The
cluster secret (`--cluster-secret`, else `PDSERVE_CLUSTER_SECRET`) is read here, once.
Logging (`--log-level`, `--log-format text|json`, `--uvicorn-log-level`, generated from
LogSettings; `pdserve serve` hands them as JSON in $PDSERVE_ROUTER_CONFIG) is set up here, once,
for the whole process (wire/log_format.py); uvicorn's loggers write through the same handler.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.app import create_app
from router.config import RouterConfig
from router.drain import DrainingServer
from text.tokenizer import read_chat_template
from wire.cluster_auth import SECRET_ENV, ClusterAuth
from wire.config_flags import add_flags, build
from wire.log_format import LogSettings

# Connections: one idle between requests (or since it opened) is closed after
# KEEP_ALIVE_TIMEOUT_S; a request line and headers must all arrive within
# REQUEST_HEAD_TIMEOUT_S of the connection being ready for them, and be at most
# MAX_REQUEST_HEAD_BYTES (else 400); the body must all arrive within REQUEST_BODY_TIMEOUT_S
# of the head (1 MiB, the largest body, at 17 KB/s).
KEEP_ALIVE_TIMEOUT_S = 5
REQUEST_HEAD_TIMEOUT_S = 10.0
REQUEST_BODY_TIMEOUT_S = 60.0
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# `pdserve serve` hands the router settings as JSON here: {"log": {LogSettings field: value}};
# flags given override them.
CONFIG_ENV = "PDSERVE_ROUTER_CONFIG"


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


def parse_args(argv: list[str] | None = None) -> tuple[RouterConfig, LogSettings]:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model folder (for the tokenizer)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names requests may send as `model`; /v1/models lists the first (default: the "
        "model path as given)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template, or a file holding one, instead of the model's",
    )
    parser.add_argument(
        "--node",
        action="append",
        required=True,
        dest="nodes",
        help="a node's PULL address, [ID=]tcp://HOST:PORT (repeatable)",
    )
    parser.add_argument("--listen", required=True, help="the router's PULL bind address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None)
    parser.add_argument("--max-n", type=int, default=8)
    parser.add_argument(
        "--max-queued-requests",
        "--max-waiting-requests",
        type=int,
        default=1024,
        metavar="N",
        help="requests (n choices each) admitted and not started yet; past it, 429 (default "
        "1024; --max-waiting-requests is the old name)",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1 << 20,
        metavar="N",
        help="prompt tokens of the requests admitted and not started yet; past it, 429 "
        "(default 1048576)",
    )
    parser.add_argument(
        "--max-queue-delay",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="refuse (429) a request that would wait longer than this before its prefill "
        "starts: queued prompt tokens / the node's measured prefill speed, or the age of the "
        "oldest request still waiting there (default 30)",
    )
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a stream whose client reads nothing for this long is aborted (default 30)",
    )
    parser.add_argument(
        "--max-stream-buffer-tokens",
        type=int,
        default=8192,
        metavar="N",
        help="tokens the router holds for a stream whose client reads slower than the "
        "model writes; past it the request is aborted (default 8192)",
    )
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="a node is dead after this long without a heartbeat (default 1.0: two missed "
        "heartbeats at the nodes' default 0.5 s interval)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may still run (default 30)",
    )
    parser.add_argument(
        "--cluster-secret",
        default=os.environ.get(SECRET_ENV) or None,
        metavar="SECRET",
        help=f"shared with every node (default: ${SECRET_ENV}); needed when --listen or a "
        "--node address is not a loopback one",
    )
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no access line per request (vLLM's spelling)",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line per node (vLLM's spelling)",
    )
    add_flags(parser, LogSettings)
    args = parser.parse_args(argv)
    names = args.served_model_name or [None]
    try:
        config = RouterConfig(
            model_path=args.model,
            served_model_name=names[0],
            served_model_aliases=tuple(names[1:]),
            chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
            host=args.host,
            port=args.port,
            node_addresses=args.nodes,
            listen_address=args.listen,
            api_key=args.api_key,
            max_n=args.max_n,
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens,
            max_queue_delay_s=args.max_queue_delay,
            stream_stall_timeout_s=args.stream_stall_timeout,
            max_stream_buffer_tokens=args.max_stream_buffer_tokens,
            node_timeout_s=args.node_timeout,
            drain_timeout_s=args.drain_timeout,
            cluster_auth=ClusterAuth.from_secret(args.cluster_secret),
            log_requests=not args.disable_log_requests,
            log_stats=not args.disable_log_stats,
        )
    except ValueError as error:
        parser.error(str(error))
    try:
        launched = json.loads(os.environ.get(CONFIG_ENV) or "{}")
        log = build(LogSettings, args, launched.get("log") if isinstance(launched, dict) else None)
    except (ValueError, TypeError) as error:
        parser.error(f"${CONFIG_ENV}: {error}")
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


if __name__ == "__main__":
    sys.exit(main())
