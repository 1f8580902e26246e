"""The router's app served on its own uvicorn configuration (router/__main__.py), in a thread,
on a free port: what a client meets on the router's connections."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from pdserve.router.__main__ import uvicorn_config
from pdserve.wire.free_ports import free_port


@contextlib.contextmanager
def serving(app, **timeouts_s: float):
    router_config = app.state.router.config
    router_config.port = free_port()
    server = uvicorn.Server(uvicorn_config(app, router_config, **timeouts_s))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{router_config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


