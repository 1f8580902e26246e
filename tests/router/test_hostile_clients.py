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
import threading
from types import SimpleNamespace

import httpx
import pytest

from pdserve.router.api.prompt_chars import max_chars_per_token
from pdserve.router.api.responses import Responder
from tests.router.fake_node import (
    MODEL,
    FakeNode,
    admission_counts,
    completion_body,
    error_count,
    make_app,
    node_stats,
    run_async,
    sse_payloads,
)

# -- failure isolation of admission places ---------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("prompts", [1, 2])
@pytest.mark.parametrize(
    "error, status, kind",
    [
        (OverflowError("Integer value out of range"), 500, "server_error"),
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

    async def scenario(http):
        return await http.post("/v1/completions", json=completion_body(False, n=2))

    reply = run_async(leaving_after_its_body(app), scenario)
    assert reply.status_code == 499
    assert admission_counts(app) == (0, 0)
    assert sorted(node.aborted) == sorted(node.submitted)
    assert error_count(app, "client_disconnected") == 1
    assert error_count(app, "server_error") == 0


def leaving_after_its_body(app):
    """`app` behind a connection whose client goes away once its request's body is sent."""

    async def wrapped(scope, receive, send):
        body_sent = False

        async def receive_until_gone():
            nonlocal body_sent
            if body_sent:
                return {"type": "http.disconnect"}
            message = await receive()
            body_sent = message["type"] == "http.request" and not message.get("more_body")
            return message

        await app(scope, receive_until_gone, send)

    wrapped.state = app.state
    return wrapped


# -- tokenizing off the event loop -----------------------------------------------------------


class WatchedTokenizer:
    """The real tokenizer, noting when and on which thread it tokenizes (`encode` or
    `apply_chat_template`)."""

    def __init__(self, inner, loop: asyncio.AbstractEventLoop, hold: threading.Event | None = None):
        self._inner = inner
        self._loop = loop
        self._hold = hold
        self.encode_started = asyncio.Event()
        self.encode_calls = 0
        self.encode_thread = ""
        self.hold_released = False

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, *args, **kwargs):
        return self._watched(self._inner.encode, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self._watched(self._inner.apply_chat_template, *args, **kwargs)

    def _watched(self, tokenize, *args, **kwargs):
        self.encode_calls += 1
        self.encode_thread = threading.current_thread().name
        self._loop.call_soon_threadsafe(self.encode_started.set)
        if self._hold is not None:
            # Tokenizing stays in progress until the test lets it go. Were this the event
            # loop's thread, nothing else could answer meanwhile and the wait would time out.
            self.hold_released = self._hold.wait(timeout=60)
        return tokenize(*args, **kwargs)


def big_chat(num_chars: int) -> dict:
    content = ("hello world " * (num_chars // 12 + 1))[:num_chars]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def test_health_answers_while_a_1_mb_message_is_tokenized(tokenizer, tmp_path):
    hold = threading.Event()

    async def main():
        watched = WatchedTokenizer(tokenizer, asyncio.get_running_loop(), hold)
        # A context large enough that the message must be tokenized; a KV cache too small
        # for the result, so the request ends with a 400 after tokenizing.
        app = make_app(watched, tmp_path, node_stats(1 << 22, block_size=16, blocks=16))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            big = asyncio.create_task(http.post("/v1/chat/completions", json=big_chat(1_000_000)))
            await asyncio.wait_for(watched.encode_started.wait(), 60)
            health = await asyncio.wait_for(http.get("/health"), 30)
            hold.set()  # the health answer came while the tokenizer was still inside its call
            big_reply = await big
        return watched, health, big_reply

    watched, health, big_reply = asyncio.run(main())
    assert health.status_code == 200
    assert watched.hold_released, "the tokenizer held the event loop"
    assert big_reply.status_code == 400, big_reply.text
    assert watched.encode_thread.startswith("router-tokenize")


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
