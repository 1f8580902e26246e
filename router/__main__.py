"""`python -m router --model PATH --node tcp://... --listen tcp://... [--port 8000]`.

Runs the app on uvicorn with uvloop and prints one line, "pdserve router listening on
http://HOST:PORT", once the socket accepts connections (with `--port 0` it shows the port the
OS picked). SIGTERM drains (router/drain.py); SIGINT shuts down without draining. The
cluster secret (`--cluster-secret`, else `PDSERVE_CLUSTER_SECRET`) is read here, once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import uvicorn

from engine.cluster_auth import SECRET_ENV, ClusterAuth
from router.app import create_app
from router.config import RouterConfig
from router.drain import DrainingServer


def parse_args(argv: list[str] | None = None) -> tuple[RouterConfig, str]:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model folder (for the tokenizer)")
    parser.add_argument("--served-model-name", default=None)
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
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = RouterConfig(
            model_path=args.model,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            node_addresses=args.nodes,
            listen_address=args.listen,
            api_key=args.api_key,
            max_n=args.max_n,
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens,
            stream_stall_timeout_s=args.stream_stall_timeout,
            max_stream_buffer_tokens=args.max_stream_buffer_tokens,
            node_timeout_s=args.node_timeout,
            drain_timeout_s=args.drain_timeout,
            cluster_auth=ClusterAuth.from_secret(args.cluster_secret),
        )
    except ValueError as error:
        parser.error(str(error))
    return config, args.log_level


async def serve(config: RouterConfig, log_level: str = "warning") -> None:
    app = create_app(config)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            loop="uvloop",
            lifespan="on",
            timeout_graceful_shutdown=5,
        ),
        app.state.router,
        config.drain_timeout_s,
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
    config, log_level = parse_args(argv)
    import uvloop

    try:
        uvloop.run(serve(config, log_level))
    except KeyboardInterrupt:  # SIGINT: uvicorn has shut down and re-raised it
        pass


if __name__ == "__main__":
    sys.exit(main())
