"""`python -m pdserve.router --model PATH --node tcp://... --listen tcp://... [--port 8000]`.

Runs the app on uvicorn with uvloop and prints one line, "pdserve router listening on
http://HOST:PORT", once the socket accepts connections (with `--port 0` it shows the port the
OS picked; with `--ssl-keyfile` and `--ssl-certfile`, https: uvicorn wraps the socket bound
here in TLS as it starts serving on it). SIGTERM drains (router/api/drain.py); SIGINT shuts
down without draining.

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
import socket
import sys
from collections.abc import Mapping
from typing import Any

import uvicorn

from pdserve.router.api.app import create_app
from pdserve.router.api.drain import DrainingServer
from pdserve.router.api.early_refusal import EarlyRefusal
from pdserve.router.api.http_connection import RequestDeadlineProtocol
from pdserve.router.config import CONFIG_ENV, RouterConfig
from pdserve.wire.config_flags import add_flags, build, from_environment, in_flag_terms
from pdserve.wire.log_format import LogSettings

# Connections (router/api/http_connection.py): one idle between requests (or since it opened) is
# closed after KEEP_ALIVE_TIMEOUT_S; a request line and headers must all arrive within
# REQUEST_HEAD_TIMEOUT_S of the connection being ready for them, and be at most
# MAX_REQUEST_HEAD_BYTES (else 400); the body must all arrive within REQUEST_BODY_TIMEOUT_S
# of the head (1 MiB, the largest body, at 17 KB/s).
KEEP_ALIVE_TIMEOUT_S = 5
REQUEST_HEAD_TIMEOUT_S = 10.0
REQUEST_BODY_TIMEOUT_S = 60.0
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# The parts of $PDSERVE_ROUTER_CONFIG (router/config.py's CONFIG_ENV).
CONFIG_PARTS = ("router", "log")


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
            RequestDeadlineProtocol,
            head_timeout_s=head_timeout_s,
            body_timeout_s=body_timeout_s,
            max_head_bytes=MAX_REQUEST_HEAD_BYTES,
            early_refusal=EarlyRefusal(app.state.router),
        ),
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]  # seconds
        root_path=config.root_path,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
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


def listening_socket(host: str, port: int) -> socket.socket:
    """The router's HTTP socket, bound before anything else starts: a port another program
    holds is one line naming the address, not uvicorn's exit status 3 after a traceback."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise SystemExit(
            f"cannot listen on {host}:{port}: {error.strerror or error}"
        ) from None


async def serve(config: RouterConfig, log: LogSettings) -> None:
    listener = listening_socket(config.host, config.port)
    port = listener.getsockname()[1]
    app = create_app(config)
    server = DrainingServer(
        uvicorn_config(app, config, log.uvicorn_level), app.state.router, config.drain_timeout_s
    )
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        if task.done():
            await task  # startup failed: surface its exception
            raise SystemExit(1)
        await asyncio.sleep(0.02)
    # What startup built (the app, the tokenizer, the imported modules) lives as long as the
    # router: out of the collector's generations, each collection during a burst scans only
    # what requests allocated (a 1,000-request burst spent 0.24 s of 1.4 s CPU in collections).
    gc.collect()
    gc.freeze()
    scheme = "https" if config.tls else "http"
    print(f"pdserve router listening on {scheme}://{config.host}:{port}", flush=True)
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
