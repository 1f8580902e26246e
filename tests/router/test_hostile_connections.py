"""The router's connections under hostile clients: a client gone while sending its body is
counted as `client_disconnected`; on the router's own uvicorn configuration (in a thread, on a
port in 21100-21199), an internal error leaves the keep-alive connection usable, and a
connection that sends nothing, or its head or body a byte at a time, is closed; an oversized
request head gets 400, whether it trickles in or comes whole; one under the bound is served.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time

import httpx

from tests.router.fake_node import (
    REPLY,
    FakeNode,
    admission_counts,
    completion_body,
    error_count,
    make_app,
    node_stats,
)
from tests.router.served import local_port, serving

# -- the request body -------------------------------------------------------------------------


def http_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }


def test_a_client_gone_while_sending_its_body_is_counted_as_disconnected(tokenizer, tmp_path):
    app = make_app(tokenizer, tmp_path, node_stats())
    messages = [
        {"type": "http.request", "body": b'{"model": "tiny", "pro', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
    asyncio.run(app(http_scope("/v1/completions", headers), receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert error_count(app, "client_disconnected") == 1
    assert error_count(app, "server_error") == 0


# -- connections (the router's uvicorn configuration, in a thread) ----------------------------


def test_after_an_internal_error_the_same_connection_serves_the_next_request(
    tokenizer, tmp_path, monkeypatch
):
    app = make_app(tokenizer, tmp_path)
    state = app.state.router
    node = FakeNode(tokenizer, fail_at=0, error=KeyError("a bug")).install(app)
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        state.client.record_stats(node_stats())
        failed = http.post("/v1/completions", json=completion_body(False))
        node.fail_at = None
        served = http.post("/v1/completions", json=completion_body(False))
        monkeypatch.setattr(state.metrics, "render", _broken_render)
        metrics_failed = http.get("/metrics")
        monkeypatch.undo()
        models = http.get("/v1/models")
        ports = {local_port(r) for r in (failed, served, metrics_failed, models)}
        metrics = http.get("/metrics").text
    assert len(ports) == 1  # one connection served them all
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == REPLY
    assert metrics_failed.status_code == 500 and metrics_failed.json()["error"]["code"] is None
    assert models.status_code == 200
    assert 'pdserve_request_errors_total{kind="server_error",model_name="tiny"} 2.0' in metrics
    assert admission_counts(app) == (0, 0)


def _broken_render() -> bytes:
    raise RuntimeError("a bug in the metrics")


def closed_after(sock: socket.socket, timeout_s: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes `sock`, sending `trickle` a byte every 0.1 s."""
    began = time.monotonic()
    pending = iter(trickle)
    while time.monotonic() - began < timeout_s:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            try:
                if sock.recv(65536) == b"":
                    return time.monotonic() - began
            except ConnectionResetError:
                return time.monotonic() - began
        byte = next(pending, None)
        if byte is not None:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - began
    raise AssertionError(f"the connection was still open after {timeout_s} s")


def big_headers(count: int) -> bytes:
    """`count` header lines of about 1 KB each."""
    return b"".join(b"X-Big-%d: %s\r\n" % (i, b"a" * 1000) for i in range(count))


def test_idle_and_slow_loris_connections_are_closed(tokenizer, tmp_path):
    app = make_app(tokenizer, tmp_path, node_stats())
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 200\r\n\r\n"
    timeouts_s = {"keep_alive_timeout_s": 0.5, "head_timeout_s": 1.5, "body_timeout_s": 1.0}
    with serving(app, **timeouts_s) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle_s = closed_after(idle, 10)
        with socket.create_connection(("127.0.0.1", port)) as loris:
            head_loris_s = closed_after(loris, 10, trickle=head)
        with socket.create_connection(("127.0.0.1", port)) as loris:
            loris.sendall(head + b'{"model": "tiny", ')
            body_loris_s = closed_after(loris, 10, trickle=b'"prompt": "' + b"x" * 200)
        with socket.create_connection(("127.0.0.1", port)) as huge:
            huge.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (20 << 10))
            huge_reply = huge.recv(65536)
        with socket.create_connection(("127.0.0.1", port)) as huge:  # whole, in one packet
            huge.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + big_headers(20) + b"\r\n")
            huge_whole_reply = huge.recv(65536)
        with socket.create_connection(("127.0.0.1", port)) as large:  # under the bound
            large.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + big_headers(12) + b"\r\n")
            large_reply = large.recv(65536)
        with httpx.Client(base_url=url) as http:
            health = [http.get("/health") for _ in range(2)]
            health_ports = {local_port(r) for r in health}
    assert 0.4 <= idle_s < 3, idle_s  # the keep-alive timeout, from the start
    assert 1.4 <= head_loris_s < 4, head_loris_s  # the head deadline, though bytes kept coming
    assert 0.9 <= body_loris_s < 4, body_loris_s  # the body deadline, likewise
    assert error_count(app, "client_disconnected") == 1  # the route reading the body
    assert error_count(app, "server_error") == 0
    assert huge_reply.startswith(b"HTTP/1.1 400")
    assert huge_whole_reply.startswith(b"HTTP/1.1 400")
    assert large_reply.startswith(b"HTTP/1.1 200"), large_reply[:100]
    assert [r.status_code for r in health] == [200, 200]
    assert len(health_ports) == 1
