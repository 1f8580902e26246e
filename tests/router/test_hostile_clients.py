"""The router under hostile or broken clients, and under its own bugs.

- Whatever fails between a request's admission and its end (a submit that raises, an error
  after the first streamed token), its admission places come back and it gets a clean
  OpenAI-shaped error; an internal error leaves the keep-alive connection usable.
- A client that goes away while sending its body is counted as `client_disconnected`.
- Tokenizing runs off the event loop (/health answers while a 1 MB message is tokenized), and
  a prompt with more characters than the context can hold is refused without tokenizing.
- uvicorn's connections: one that sends nothing, or sends its head or its body a byte at a
  time, is closed; an oversized request head gets 400.

Nodes are simulated in-process: NodeStats injected into the app's node client and a fake
`submit` that answers from the event loop (or raises). Connection tests run the router's own
uvicorn configuration in a thread, on a port in 21100-21199.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from starlette.requests import Request

from pdserve.router.__main__ import uvicorn_config
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.prompt_chars import max_chars_per_token
from pdserve.router.responses import Responder
from pdserve.wire.messages import NodeStats, TokenUpdate

MODEL = "tiny"
REPLY = "hello there"
PORTS = range(21100, 21200)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from pdserve.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama_dir)


def node_stats(max_model_len: int = 256, block_size: int = 0, blocks: int = 64) -> NodeStats:
    return NodeStats(
        node_id="n0",
        role="colocated",
        max_model_len=max_model_len,
        vocab_size=512,
        num_waiting=0,
        num_running=0,
        num_free_blocks=blocks,
        num_total_blocks=blocks,
        num_preemptions=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
        block_size=block_size,
    )


def make_app(tokenizer, tmp_path, stats: NodeStats | None = None):
    config = RouterConfig(
        model_path="unused",
        served_model_name=MODEL,
        node_addresses=[f"ipc://{tmp_path}/node"],
        listen_address=f"ipc://{tmp_path}/router",
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: longer than the default 1 s
    )
    app = create_app(config, tokenizer=tokenizer)
    if stats is not None:
        app.state.router.client.record_stats(stats)
    return app


class FakeNode:
    """Stands in for `NodeClient.submit_choices` and `abort`: each choice gets REPLY's tokens
    (in two updates) soon after its prompt is submitted; submit call number `fail_at` (one
    call per prompt) raises `error`."""

    def __init__(self, tokenizer, fail_at: int | None = None, error: Exception | None = None):
        self.reply_ids = list(tokenizer.encode(REPLY))
        self.fail_at = fail_at
        self.error = error
        self.num_calls = 0
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def install(self, app) -> FakeNode:
        client = app.state.router.client
        client.submit_choices = self.submit_choices
        client.abort = self.aborted.append
        return self

    def submit_choices(self, prompt_id, prompt_ids, choices, queue=None, priority=0):
        if self.num_calls == self.fail_at:
            raise self.error
        self.num_calls += 1
        loop = asyncio.get_running_loop()
        half = len(self.reply_ids) // 2
        for request_id, _ in choices:
            self.submitted.append(request_id)
            updates = [
                TokenUpdate(request_id, self.reply_ids[:half], None, len(prompt_ids)),
                TokenUpdate(
                    request_id, self.reply_ids[half:], "length", len(prompt_ids), offset=half
                ),
            ]
            for update in updates:
                loop.call_soon(queue.put_nowait, update)
        return queue


def run_async(app, scenario):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            return await scenario(http)

    return asyncio.run(main())


def admission_counts(app) -> tuple[int, int]:
    admission = app.state.router.admission
    return admission.num_requests, admission.num_tokens


def error_count(app, kind: str) -> float:
    value = app.state.router.metrics.request_errors.labels(kind)._value.get()
    return float(value)


def completion_body(stream: bool, n: int = 1, prompts: int = 1) -> dict:
    prompt = "hi" if prompts == 1 else ["hi"] * prompts
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": n, "stream": stream}


def sse_payloads(text: str) -> list:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# -- failure isolation of admission places ---------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("prompts", [1, 2])
@pytest.mark.parametrize(
    "error, status, kind",
    [
        (OverflowError("Integer value out of range"), 400, "invalid_request_error"),
        (ValueError("request id in use"), 500, "server_error"),
        (KeyError("a bug"), 500, "server_error"),
    ],
    ids=["overflow", "value", "key"],
)
def test_a_submit_that_raises_gives_back_every_admission_place(
    tokenizer, tmp_path, stream, prompts, error, status, kind
):
    app = make_app(tokenizer, tmp_path, node_stats())
    node = FakeNode(tokenizer, fail_at=prompts - 1, error=error).install(app)

    async def scenario(http):
        return await http.post("/v1/completions", json=completion_body(stream, 2, prompts))

    reply = run_async(app, scenario)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["error"]["type"] == kind
    assert admission_counts(app) == (0, 0)
    assert node.aborted == node.submitted  # the prompt sent before the failure is aborted
    assert len(node.submitted) == 2 * (prompts - 1)  # its two choices


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_bug_before_the_first_token_is_a_500_and_gives_back_every_place(
    tokenizer, tmp_path, monkeypatch, stream
):
    from pdserve.router.generation import Generation

    app = make_app(tokenizer, tmp_path, node_stats())
    node = FakeNode(tokenizer).install(app)

    def broken_update(self, choice, update):
        raise KeyError("a bug in handling a token update")

    monkeypatch.setattr(Generation, "_handle_update", broken_update)

    async def scenario(http):
        return await http.post("/v1/completions", json=completion_body(stream, n=2))

    reply = run_async(app, scenario)
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert admission_counts(app) == (0, 0)
    assert len(node.submitted) == 2 and sorted(node.aborted) == sorted(node.submitted)
    assert error_count(app, "server_error") == 1


def test_a_sampling_value_too_large_for_the_wire_is_a_400_naming_it(tokenizer, tmp_path):
    from pdserve.router.generation import Generation
    from pdserve.router.validation import Plan

    app = make_app(tokenizer, tmp_path, node_stats())
    state = app.state.router
    FakeNode(tokenizer, fail_at=0, error=OverflowError("Integer value out of range")).install(app)
    plan = Plan([[5, 6]], [{"top_k": 1 << 70, "max_tokens": 4}], [])
    generation = Generation("cmpl-x", plan, state.client, tokenizer, state.metrics, state.admission)
    with pytest.raises(APIError) as refused:
        generation.start()
    assert refused.value.status == 400 and refused.value.param == "top_k"
    assert admission_counts(app) == (1, 2)  # held until the owner closes the generation
    generation.close()
    generation.close()
    assert admission_counts(app) == (0, 0)


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(
    tokenizer, tmp_path, monkeypatch
):
    app = make_app(tokenizer, tmp_path, node_stats())
    FakeNode(tokenizer).install(app)
    real_event_chunk = Responder._event_chunk
    calls = []

    def failing_second_chunk(self, event):
        calls.append(event)
        if len(calls) == 2:
            raise RuntimeError("a bug in the second chunk")
        return real_event_chunk(self, event)

    monkeypatch.setattr(Responder, "_event_chunk", failing_second_chunk)

    async def scenario(http):
        return await http.post("/v1/completions", json=completion_body(True, n=2))

    reply = run_async(app, scenario)
    assert reply.status_code == 200
    payloads = sse_payloads(reply.text)
    assert payloads[-1]["error"]["type"] == "server_error"
    assert admission_counts(app) == (0, 0)
    assert error_count(app, "server_error") == 1


def test_a_client_gone_while_the_request_waits_is_counted_and_gives_back_its_places(
    tokenizer, tmp_path, monkeypatch
):
    app = make_app(tokenizer, tmp_path, node_stats())
    node = FakeNode(tokenizer).install(app)

    def submit_silently(request_id, prompt_ids, sampling, queue=None, priority=0):
        node.submitted.append(request_id)  # and no token ever comes
        return queue

    app.state.router.client.submit = submit_silently
    monkeypatch.setattr(Request, "is_disconnected", _always_disconnected)

    async def scenario(http):
        return await http.post("/v1/completions", json=completion_body(False, n=2))

    reply = run_async(app, scenario)
    assert reply.status_code == 499
    assert admission_counts(app) == (0, 0)
    assert sorted(node.aborted) == sorted(node.submitted)
    assert error_count(app, "client_disconnected") == 1
    assert error_count(app, "server_error") == 0


async def _always_disconnected(self) -> bool:
    return True


# -- tokenizing off the event loop -----------------------------------------------------------


class WatchedTokenizer:
    """The real tokenizer, noting when and on which thread it tokenizes (`encode` or
    `apply_chat_template`)."""

    def __init__(self, inner, loop: asyncio.AbstractEventLoop) -> None:
        self._inner = inner
        self._loop = loop
        self.encode_started = asyncio.Event()
        self.encode_calls = 0
        self.encode_thread = ""
        self.encode_began_at = 0.0
        self.encode_ended_at = 0.0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, *args, **kwargs):
        return self._watched(self._inner.encode, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self._watched(self._inner.apply_chat_template, *args, **kwargs)

    def _watched(self, tokenize, *args, **kwargs):
        self.encode_calls += 1
        self.encode_thread = threading.current_thread().name
        self.encode_began_at = time.monotonic()
        self._loop.call_soon_threadsafe(self.encode_started.set)
        try:
            return tokenize(*args, **kwargs)
        finally:
            self.encode_ended_at = time.monotonic()


def big_chat(num_chars: int) -> dict:
    content = ("hello world " * (num_chars // 12 + 1))[:num_chars]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def test_health_answers_while_a_1_mb_message_is_tokenized(tokenizer, tmp_path):
    async def main():
        watched = WatchedTokenizer(tokenizer, asyncio.get_running_loop())
        # A context large enough that the message must be tokenized; a KV cache too small
        # for the result, so the request ends with a 400 after tokenizing.
        app = make_app(watched, tmp_path, node_stats(1 << 22, block_size=16, blocks=16))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            big = asyncio.create_task(http.post("/v1/chat/completions", json=big_chat(1_000_000)))
            await asyncio.wait_for(watched.encode_started.wait(), 60)
            asked_at = time.monotonic()
            health = await http.get("/health")
            answered_at = time.monotonic()
            big_reply = await big
        return watched, health, big_reply, asked_at, answered_at

    watched, health, big_reply, asked_at, answered_at = asyncio.run(main())
    assert health.status_code == 200
    assert big_reply.status_code == 400, big_reply.text
    assert watched.encode_thread.startswith("router-tokenize")
    tokenize_s = watched.encode_ended_at - watched.encode_began_at
    assert answered_at < watched.encode_ended_at, (answered_at - asked_at, tokenize_s)
    assert answered_at - asked_at < tokenize_s / 4, (answered_at - asked_at, tokenize_s)


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_a_prompt_longer_than_the_context_can_hold_is_refused_without_tokenizing(
    tokenizer, tmp_path, route
):
    async def main():
        watched = WatchedTokenizer(tokenizer, asyncio.get_running_loop())
        app = make_app(watched, tmp_path, node_stats(max_model_len=64))
        text = big_chat(1_000_000)["messages"][0]["content"]
        if route == "chat":
            path, body = "/v1/chat/completions", big_chat(1_000_000)
        else:
            path, body = "/v1/completions", {"model": MODEL, "prompt": text}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            reply = await http.post(path, json=body)
        return watched, reply, app

    watched, reply, app = asyncio.run(main())
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "maximum context length is 64 tokens" in error["message"]
    assert "1,000,000 characters" in error["message"]
    assert error["param"] == ("messages" if route == "chat" else "prompt")
    assert watched.encode_calls == 0
    assert admission_counts(app) == (0, 0)


def test_a_prompt_within_the_character_bound_is_still_tokenized(tokenizer, tmp_path):
    bound = max_chars_per_token(tokenizer)
    assert bound == max(len(token) for token in tokenizer.backend_tokenizer.get_vocab())

    async def main():
        watched = WatchedTokenizer(tokenizer, asyncio.get_running_loop())
        app = make_app(watched, tmp_path, node_stats(max_model_len=64))
        body = {"model": MODEL, "prompt": "x" * (64 * bound)}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return watched, await http.post("/v1/completions", json=body)

    watched, reply = asyncio.run(main())
    assert watched.encode_calls == 1
    assert reply.status_code == 400 and "maximum context length" in reply.json()["error"]["message"]


def test_no_character_bound_for_a_tokenizer_that_may_shorten_text():
    from tokenizers import Tokenizer, models, normalizers

    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    assert max_chars_per_token(SimpleNamespace(backend_tokenizer=backend)) == 1
    backend.normalizer = normalizers.NFC()
    assert max_chars_per_token(SimpleNamespace(backend_tokenizer=backend)) is None
    assert max_chars_per_token(object()) is None


def test_without_a_node_parameters_are_checked_before_the_503(tokenizer, tmp_path):
    app = make_app(tokenizer, tmp_path)

    async def scenario(http):
        chat = big_chat(100)
        bad = await http.post("/v1/chat/completions", json={**chat, "n": 0})
        good = await http.post("/v1/chat/completions", json=chat)
        return bad, good

    bad, good = run_async(app, scenario)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    assert good.status_code == 503


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


def free_port() -> int:
    for port in PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS}")


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
        with httpx.Client(base_url=url) as http:
            health = [http.get("/health") for _ in range(2)]
            health_ports = {local_port(r) for r in health}
    assert 0.4 <= idle_s < 3, idle_s  # the keep-alive timeout, from the start
    assert 1.4 <= head_loris_s < 4, head_loris_s  # the head deadline, though bytes kept coming
    assert 0.9 <= body_loris_s < 4, body_loris_s  # the body deadline, likewise
    assert error_count(app, "client_disconnected") == 1  # the route reading the body
    assert error_count(app, "server_error") == 0
    assert huge_reply.startswith(b"HTTP/1.1 400")
    assert [r.status_code for r in health] == [200, 200]
    assert len(health_ports) == 1
