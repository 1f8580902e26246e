"""Tool calls, the answer side: a choice's text turned into `message.tool_calls` (ids
`call_...`, arguments as JSON text, `finish_reason: "tool_calls"`, content null) or into
streamed `delta.tool_calls` entries that reassemble into the same calls, per `tool_choice`;
through the whole router against a scripted node that answers with a given text."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from pdserve.router.api.app import create_app
from pdserve.router.api.tool_output import ToolCallOutput
from pdserve.router.api.tools import ToolMode, ToolPlan
from pdserve.router.config import RouterConfig
from pdserve.wire.messages import Generate, TokenBatch, TokenUpdate, decode, encode
from tests.node_stats import node_stats
from tests.router.test_streaming import ScriptedNode, sse_payloads
from tests.router.test_tools import TOOLS, WEATHER

MODEL = "tiny"
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
HERMES_REPLY = (
    'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
)


def plan(mode: ToolMode, named: str | None = None, parallel: bool = True) -> ToolPlan:
    return ToolPlan(tuple(TOOLS), mode, named, parallel)


def reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Content and calls from streamed deltas, as the openai client accumulates them."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in entry:
                    call[key] = entry[key]
            function = entry.get("function", {})
            if "name" in function:
                call["function"]["name"] = function["name"]
            call["function"]["arguments"] += function.get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def stream(output: ToolCallOutput, text: str, finish: str, step: int = 3) -> tuple[list, str]:
    deltas, last = [], None
    for start in range(0, len(text), step):
        end = start + step >= len(text)
        delta, reason = output.delta(0, text[start : start + step], finish if end else None)
        if delta is not None:
            deltas.append(delta)
        last = reason or last
    return deltas, last


def whole(output: ToolCallOutput, text: str, finish: str) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": finish}
    output.message(choice)
    return choice


def test_auto_hermes_calls_become_tool_calls_and_the_rest_content():
    choice = whole(ToolCallOutput(plan(ToolMode.AUTO), 1), HERMES_REPLY, "stop")
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Checking."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "now"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(CALL_ID.match(c["id"]) and c["type"] == "function" for c in message["tool_calls"])
    assert all("index" not in c for c in message["tool_calls"])
    ids = {c["id"] for c in message["tool_calls"]}
    assert len(ids) == 2


def test_auto_without_calls_or_with_a_malformed_one_is_plain_content():
    for text in ("Just text.", '<tool_call>{"name": "get_weather"</tool_call>'):
        choice = whole(ToolCallOutput(plan(ToolMode.AUTO), 1), text, "stop")
        assert choice["message"] == {"role": "assistant", "content": text}
        assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("step", [1, 4, 50])
def test_streamed_auto_deltas_reassemble_into_the_same_calls(step):
    deltas, finish = stream(ToolCallOutput(plan(ToolMode.AUTO), 1), HERMES_REPLY, "stop", step)
    content, calls = reassemble(deltas)
    message = whole(ToolCallOutput(plan(ToolMode.AUTO), 1), HERMES_REPLY, "stop")["message"]
    assert finish == "tool_calls" and content == message["content"]
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    assert [c["index"] for d in deltas for c in d.get("tool_calls", [])] == [0, 1]


def test_named_function_streams_its_header_first_then_the_arguments():
    output = ToolCallOutput(plan(ToolMode.NAMED, "get_weather"), 1)
    deltas, finish = stream(output, '{"city": "Paris"}', "stop", step=4)
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and CALL_ID.match(first["id"]) and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])
    _, calls = reassemble(deltas)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert finish == "tool_calls" and all("content" not in d for d in deltas)


def test_named_function_in_one_message():
    output = ToolCallOutput(plan(ToolMode.NAMED, "get_weather"), 1)
    choice = whole(output, '{"city": "Rome", "unit": "C"}', "stop")
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}


@pytest.mark.parametrize(
    ("parallel", "text", "names"),
    [
        (True, ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
               '{"name": "now", "arguments": {}}]'), ["get_weather", "now"]),
        (False, '{"name": "now", "arguments": {}}', ["now"]),
    ],
)
def test_required_calls_are_read_when_the_choice_ends(parallel, text, names):
    output = ToolCallOutput(plan(ToolMode.REQUIRED, parallel=parallel), 1)
    deltas, finish = stream(output, text, "stop", step=5)
    assert len(deltas) == 1 and finish == "tool_calls"  # nothing before the end
    _, calls = reassemble(deltas)
    assert [c["function"]["name"] for c in calls] == names
    choice = whole(ToolCallOutput(plan(ToolMode.REQUIRED, parallel=parallel), 1), text, "stop")
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names


def test_required_output_cut_by_max_tokens_is_content_with_finish_length():
    text = '[{"name": "get_weather", "arguments": {"ci'
    choice = whole(ToolCallOutput(plan(ToolMode.REQUIRED), 1), text, "length")
    assert choice["message"]["content"] == text and choice["finish_reason"] == "length"
    deltas, finish = stream(ToolCallOutput(plan(ToolMode.REQUIRED), 1), text, "length")
    assert deltas == [{"content": text}] and finish == "length"


# -- through the router ----------------------------------------------------------------------


class TextNode(ScriptedNode):
    """Answers every Generate with `text`, one token per batch, ending with "stop"."""

    text = ""

    async def run(self) -> None:
        stats = node_stats(max_model_len=4096)
        await self.push.send(encode(stats))
        while True:
            message = decode(await self.pull.recv())
            if isinstance(message, Generate):
                self.generates.append(message)
                asyncio.create_task(self.reply(message))

    async def reply(self, message) -> None:
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        for i, token in enumerate(ids):
            await asyncio.sleep(0.001)
            last = i == len(ids) - 1
            update = TokenUpdate(message.request_id, [token], "stop" if last else None,
                                 len(message.prompt_token_ids), None, offset=i)
            await self.push.send(encode(TokenBatch("n0", [update])))


def run_chat(tmp_path, tokenizer, text: str, body: dict):
    node_addr, router_addr = f"ipc://{tmp_path}/node", f"ipc://{tmp_path}/router"
    config = RouterConfig(model_path="unused", served_model_name=MODEL,
                          node_addresses=[node_addr], listen_address=router_addr)
    app = create_app(config, tokenizer=tokenizer)

    async def main():
        state = app.state.router
        await state.client.start()
        node = TextNode(tokenizer, node_addr, router_addr)
        node.text = text
        task = asyncio.create_task(node.run())
        try:
            while not state.client.any_alive():
                await asyncio.sleep(0.01)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "tools": TOOLS, "max_tokens": 200, **body}
                return await http.post("/v1/chat/completions", json=request), node
        finally:
            task.cancel()
            await state.client.stop()
            node.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from pdserve.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama_dir)


def test_a_required_call_through_the_router(tmp_path, tokenizer):
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    r, node = run_chat(tmp_path, tokenizer, text, {"tool_choice": "required"})
    assert r.status_code == 200, r.text
    spec = node.generates[0].sampling.structured_output["json_schema"]
    assert spec["type"] == "array"
    assert spec["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'
    }


def test_streamed_auto_calls_through_the_router(tmp_path, tokenizer):
    r, _ = run_chat(tmp_path, tokenizer, HERMES_REPLY, {"stream": True})
    chunks = sse_payloads(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content, calls = reassemble(deltas)
    assert content == "Checking."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert all(CALL_ID.match(c["id"]) for c in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
