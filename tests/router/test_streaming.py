"""Router generation paths against a scripted in-test node speaking the wire protocol over
ZeroMQ (ipc sockets): detokenization, stop strings with Abort, n with seeds, SSE framing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import zmq
import zmq.asyncio

from pdserve.router.api.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.wire.messages import (
    Abort,
    Generate,
    TokenBatch,
    TokenUpdate,
    decode,
    encode,
)
from tests.node_stats import node_stats

MODEL = "tiny"
REPLY = "hello world, again"


def one_per_choice(message: Generate) -> list[Generate]:
    """A Generate as the lone requests of its choices (itself, without choices)."""
    if not message.choices:
        return [message]
    return [
        Generate(c.request_id, message.prompt_token_ids, c.sampling, priority=message.priority)
        for c in message.choices
    ]


class ScriptedNode:
    """Answers every Generate with REPLY's tokens, one per batch, unless aborted."""

    def __init__(self, tokenizer, listen: str, router: str) -> None:
        self.tokenizer = tokenizer
        self.context = zmq.asyncio.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind(listen)
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(router)
        self.messages: list[Generate] = []  # as sent: a prompt's n choices in one
        self.generates: list[Generate] = []  # one per choice, as a lone request's
        self.aborted: set[str] = set()
        self.delay = 0.005
        self.reply_text = REPLY

    async def run(self) -> None:
        stats = node_stats(max_model_len=256)
        await self.push.send(encode(stats))
        while True:
            message = decode(await self.pull.recv())
            if isinstance(message, Abort):
                self.aborted.add(message.request_id)
            elif isinstance(message, Generate):
                self.messages.append(message)
                for generate in one_per_choice(message):
                    self.generates.append(generate)
                    asyncio.create_task(self.reply(generate))

    async def reply(self, message: Generate) -> None:
        ids = self.tokenizer.encode(self.reply_text)[: message.sampling.max_tokens]
        for i, token in enumerate(ids):
            await asyncio.sleep(self.delay)
            if message.request_id in self.aborted:
                return
            last = i == len(ids) - 1
            logprobs = [[token, -0.5, [[token, -0.5]]]] if message.sampling.logprobs is not None else None
            update = TokenUpdate(
                message.request_id,
                [token],
                "length" if last else None,
                len(message.prompt_token_ids),
                logprobs,
                offset=i,
            )
            await self.push.send(encode(TokenBatch("n0", [update])))

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.context.term()


def run_with_node(tmp_path, tokenizer, scenario, **settings):
    """`scenario(http, node)` against a router (RouterConfig `settings` added) and a
    ScriptedNode."""
    node_addr, router_addr = f"ipc://{tmp_path}/node", f"ipc://{tmp_path}/router"
    config = RouterConfig(
        model_path="unused",
        served_model_name=MODEL,
        node_addresses=[node_addr],
        listen_address=router_addr,
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: the timeout must hold
        **settings,
    )
    app = create_app(config, tokenizer=tokenizer)

    async def main():
        state = app.state.router
        await state.client.start()
        node = ScriptedNode(tokenizer, node_addr, router_addr)
        node_task = asyncio.create_task(node.run())
        try:
            for _ in range(200):
                if state.client.any_alive():
                    break
                await asyncio.sleep(0.01)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return await scenario(http, node)
        finally:
            node_task.cancel()
            await state.client.stop()
            node.close()

    return asyncio.run(main())


def sse_payloads(text: str) -> list:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_with_stop_string_aborts_node(tmp_path, tokenizer):
    async def scenario(http, node):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stop": "wor", "n": 2, "seed": 7}
        r = await http.post("/v1/completions", json=body)
        for _ in range(100):
            if len(node.aborted) == 2:
                break
            await asyncio.sleep(0.02)
        return r, node

    r, node = run_with_node(tmp_path, tokenizer, scenario)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion"
    assert [c["text"] for c in data["choices"]] == ["hello ", "hello "]
    assert [c["finish_reason"] for c in data["choices"]] == ["stop", "stop"]
    assert sorted(g.sampling.seed for g in node.generates) == [7, 8]
    assert all(not g.sampling.stop for g in node.generates)  # the router cuts at them
    assert node.aborted == {g.request_id for g in node.generates}
    assert data["usage"]["prompt_tokens"] == 2


def test_completion_length_with_logprobs(tmp_path, tokenizer):
    async def scenario(http, node):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5, "logprobs": 1}
        return await http.post("/v1/completions", json=body)

    data = run_with_node(tmp_path, tokenizer, scenario).json()
    choice = data["choices"][0]
    assert choice["text"] == "hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == list("hello")
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    assert data["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(tmp_path, tokenizer):
    async def scenario(http, node):
        completion = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1,
                      "return_tokens_as_token_ids": True}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
                "return_tokens_as_token_ids": True}
        return [(await http.post(path, json=body)).json()
                for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat))]

    completion, chat = run_with_node(tmp_path, tokenizer, scenario)
    ids = tokenizer.encode(REPLY)[:3]
    logprobs = completion["choices"][0]["logprobs"]
    assert completion["choices"][0]["text"] == "hel"  # the text is still text
    assert logprobs["tokens"] == [f"token_id:{i}" for i in ids]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[f"token_id:{i}"] for i in ids]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{i}" for i in ids]
    assert content[0]["top_logprobs"][0]["token"] == f"token_id:{ids[0]}"


def test_chat_stream_framing_and_usage(tmp_path, tokenizer):
    async def scenario(http, node):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 50,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return await http.post("/v1/chat/completions", json=body)

    r = run_with_node(tmp_path, tokenizer, scenario)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(REPLY)
    assert all("usage" in c for c in chunks)


def test_metrics_count_finished_requests(tmp_path, tokenizer):
    async def scenario(http, node):
        await http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3})
        return await http.get("/metrics")

    text = run_with_node(tmp_path, tokenizer, scenario).text
    assert 'pdserve_request_success_total{finish_reason="length",model_name="tiny"} 1.0' in text
    assert 'pdserve_generation_tokens_total{model_name="tiny"} 3.0' in text
    assert 'pdserve_kv_cache_usage_ratio{model_name="tiny",node="n0"} 0.0' in text


def _generation(http_app_state, prompt_ids, n=2):
    from pdserve.router.api.validation import Plan
    from pdserve.router.generation import Generation
    from pdserve.wire.sampling_params import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=50)
    plan = Plan([prompt_ids], [sampling] * n, [])
    state = http_app_state
    return Generation("cmpl-test", plan, state.client, state.tokenizer, state.metrics)


def _run_generation_scenario(tmp_path, tokenizer, body, delay=0.005):
    node_addr, router_addr = f"ipc://{tmp_path}/node", f"ipc://{tmp_path}/router"
    config = RouterConfig(
        model_path="unused",
        served_model_name=MODEL,
        node_addresses=[node_addr],
        listen_address=router_addr,
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: the timeout must hold
    )
    state = create_app(config, tokenizer=tokenizer).state.router

    async def main():
        await state.client.start()
        node = ScriptedNode(tokenizer, node_addr, router_addr)
        node.delay = delay
        node_task = asyncio.create_task(node.run())
        try:
            while not state.client.any_alive():
                await asyncio.sleep(0.01)
            generation = _generation(state, [5, 6])
            generation.start()
            await body(generation)
            for _ in range(100):  # the PUSH socket may still be reconnecting (100 ms)
                if len(node.aborted) == 2:
                    break
                await asyncio.sleep(0.02)
            return node, state
        finally:
            node_task.cancel()
            await state.client.stop()
            node.close()

    return asyncio.run(main())


def test_closing_a_stream_aborts_every_choice(tmp_path, tokenizer):
    async def body(generation):
        events = generation.events()
        await anext(events)
        await events.aclose()

    node, state = _run_generation_scenario(tmp_path, tokenizer, body)
    assert node.aborted == {"cmpl-test-0", "cmpl-test-1"}
    assert not state.client.inflight


class Connection:
    """An ASGI receive whose client goes away when `leave()` is called; counts its calls."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.calls = 0

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict:
        self.calls += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_disconnect_while_waiting_aborts(tmp_path, tokenizer):
    from pdserve.router.generation import ClientDisconnected

    connection = Connection()

    async def body(generation):
        asyncio.get_running_loop().call_later(0.2, connection.leave)
        with pytest.raises(ClientDisconnected):
            async for _ in generation.events(connection.receive):
                pass

    node, state = _run_generation_scenario(tmp_path, tokenizer, body, delay=0.5)
    assert node.aborted == {"cmpl-test-0", "cmpl-test-1"}
    assert not state.client.inflight
    assert connection.calls == 1  # one wait, not a poll


def test_a_stream_stops_watching_its_client_after_the_first_event(tmp_path, tokenizer):
    """From the first event on, the streaming response watches the connection itself: the
    generation's own watcher is gone, so a client that leaves later is not seen here."""
    connection = Connection()
    events_seen = []

    async def body(generation):
        async for events in generation.events(connection.receive, watch_until_first_event=True):
            events_seen.append(events)
            connection.leave()

    _run_generation_scenario(tmp_path, tokenizer, body, delay=0.05)
    assert len(events_seen) > 1  # ran to its end after the client "left"
