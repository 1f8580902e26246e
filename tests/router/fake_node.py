"""The router app of the hostile-client tests, with a stand-in for its nodes: NodeStats injected
into the node client and a fake `submit` that answers from the event loop (or raises)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from pdserve.router.api.app import create_app
from pdserve.wire.messages import NodeStats, TokenUpdate
from tests.router import unlooped

MODEL = "tiny"
REPLY = "hello there"


def node_stats(max_model_len: int = 256, block_size: int = 0, blocks: int = 64) -> NodeStats:
    return unlooped.node_stats(max_model_len, blocks=blocks, block_size=block_size)


def make_app(tokenizer, tmp_path, stats: NodeStats | None = None):
    # One NodeStats and no heartbeats: a node timeout that holds for the whole test.
    config = unlooped.unlooped_router_config(Path("unused"), MODEL, node_timeout_s=30.0)
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

    def submit_choices(self, prompt_id, prompt_ids, choices, queue=None, priority=0, group=None):
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
