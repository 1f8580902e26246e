"""Completions with a list of prompts (router/api/prompts.py): OpenAI's four forms, each prompt
named in its errors, prompts x n bounded, choices indexed `prompt * n + i` in JSON and SSE,
usage summed over the prompts, and admission counting every prompt of a batch."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.validation import Plan
from pdserve.router.cluster.admission import AdmissionQueue
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.generation import Generation
from pdserve.router.metrics import RouterMetrics
from pdserve.wire.messages import TokenBatch, TokenUpdate, encode
from pdserve.wire.sampling_params import SamplingParams
from tests.router import test_streaming
from tests.router.test_queue_delay import client_with
from tests.router.test_streaming import ScriptedNode, run_with_node, sse_payloads
from tests.router.test_validation import MODEL, assert_error
from tests.router.unlooped import node_stats, unlooped_router_config

WORDS = ["apple", "river", "stone"]


def echoed(tokenizer, prompt: list[int]) -> list[int]:
    bos = tokenizer.backend_tokenizer.token_to_id(tokenizer.special_tokens.get("bos_token", ""))
    return prompt[1:] if prompt and prompt[0] == bos else prompt


class EchoNode(ScriptedNode):
    """Answers every Generate with its own prompt's tokens (BOS aside), one per batch."""

    async def reply(self, message):
        ids = echoed(self.tokenizer, message.prompt_token_ids)[: message.sampling.max_tokens]
        for i, token in enumerate(ids):
            await asyncio.sleep(self.delay)
            update = TokenUpdate(
                message.request_id, [token], "length" if i == len(ids) - 1 else None,
                len(message.prompt_token_ids), None, offset=i,
            )
            await self.push.send(encode(TokenBatch("n0", [update])))


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setattr(test_streaming, "ScriptedNode", EchoNode)


@pytest.fixture(scope="module")
def app(tiny_llama_dir):
    config = unlooped_router_config(
        tiny_llama_dir,
        MODEL,
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: the timeout must hold
        max_choices=6,
    )
    return create_app(config)


@pytest.fixture
def live(app):
    app.state.router.client.record_stats(node_stats())
    return TestClient(app)


def complete(client, **fields):
    body = json.dumps({"model": MODEL, "max_tokens": 2, **fields})  # escapes lone surrogates
    return client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )


BAD_PROMPTS = [
    ([5, "a"], "prompt[1]"),
    ([5, 6.0], "prompt[1]"),
    ([5, True], "prompt[1]"),
    (["a", 5], "prompt[1]"),
    (["a", ["b"]], "prompt[1]"),
    ([[5], 6], "prompt[1]"),
    ([[5], [6, "x"]], "prompt[1]"),
    ([[5], [None]], "prompt[1]"),
    ([None], "prompt[0]"),
    ([{"a": 1}], "prompt[0]"),
    ([], "prompt"),
    (["a", ""], "prompt[1]"),
    ([[5], []], "prompt[1]"),
    (["a", "ok \ud800"], "prompt[1]"),
    ([[5], [6, 512]], "prompt[1]"),
    ([[5], [-1]], "prompt[1]"),
    (["a", "x " * 400], "prompt[1]"),  # over the context length (64 tokens)
]


@pytest.mark.parametrize(("prompt", "param"), BAD_PROMPTS)
def test_a_bad_prompt_of_a_batch_is_400_naming_it(live, prompt, param):
    assert_error(complete(live, prompt=prompt), 400, param)


def test_prompts_times_n_is_bounded(live):
    error = assert_error(complete(live, prompt=["a", "b", "c", "d"], n=2), 400, "prompt")
    assert "at most 6 completions" in error["message"] and "4 prompts x n=2" in error["message"]
    assert_error(complete(live, prompt=[[5]] * 7), 400, "prompt")


def test_a_batch_within_the_bound_passes_validation(app):
    app.state.router.client.nodes[0].stats = None
    client = TestClient(app)
    for prompt in (["a", "b", "c"], [[5, 6], [7]], [5, 6], "a"):
        assert_error(complete(client, prompt=prompt, n=2), 503)


def test_batched_prompts_answer_prompt_times_n_plus_i_with_summed_usage(
    tmp_path, tokenizer, echo
):
    async def scenario(http, node):
        body = {"model": MODEL, "prompt": WORDS, "max_tokens": 8, "n": 2, "seed": 40}
        return await http.post("/v1/completions", json=body), node

    r, node = run_with_node(tmp_path, tokenizer, scenario)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == list(range(6))
    for choice in data["choices"]:
        assert choice["text"].strip() == WORDS[choice["index"] // 2], data["choices"]
    prompts = [tokenizer.encode(w) for w in WORDS]
    by_id = {g.request_id.rsplit("-", 1)[1]: g for g in node.generates}
    for i in range(6):
        assert by_id[str(i)].prompt_token_ids == prompts[i // 2]
        assert by_id[str(i)].sampling.seed == 40 + i % 2  # as each prompt's own request
    assert data["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert data["usage"]["completion_tokens"] == 2 * sum(len(echoed(tokenizer, p)) for p in prompts)
    assert len(node.messages) == 3  # one Generate per prompt, carrying its two choices
    for p, message in enumerate(node.messages):
        assert message.prompt_token_ids == prompts[p]
        assert [c.request_id.rsplit("-", 1)[1] for c in message.choices] == [str(2 * p), str(2 * p + 1)]
        assert message.request_id not in {c.request_id for c in message.choices}


def test_streamed_batched_token_prompts_carry_every_index(tmp_path, tokenizer, echo):
    prompts = [tokenizer.encode(w) for w in WORDS[:2]]

    async def scenario(http, node):
        body = {"model": MODEL, "prompt": prompts, "max_tokens": 8, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        return await http.post("/v1/completions", json=body)

    r = run_with_node(tmp_path, tokenizer, scenario)
    assert r.status_code == 200, r.text
    chunks = sse_payloads(r.text)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == [0, 1, 2, 3] and set(finishes.values()) == {"length"}
    assert [texts[i].strip() for i in range(4)] == ["apple", "apple", "river", "river"]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == 2 * sum(len(echoed(tokenizer, p)) for p in prompts)


def _batch_plan(prompts: list[list[int]], n: int) -> Plan:
    return Plan(prompts, [SamplingParams(max_tokens=4)] * (len(prompts) * n), [])


def test_admission_and_the_queue_delay_count_every_prompt_of_a_batch(tokenizer):
    config = RouterConfig(model_path="unused")
    admission = AdmissionQueue(config)
    plan = _batch_plan([[5] * 3, [6] * 10], n=2)

    async def run():
        client, _ = client_with("c", max_queue_delay_s=1000.0)
        generation = Generation("cmpl-b", plan, client, tokenizer, RouterMetrics("tiny"), admission)
        generation.start()
        held = (admission.num_requests, admission.num_tokens)
        queued = client.prompt_queues.tokens(client.nodes[0])
        generation.close()
        return held, queued

    held, queued = asyncio.run(run())
    assert held == (4, 2 * 3 + 2 * 10)
    assert queued == 3 + 10  # each prompt is computed once for its two choices
    assert (admission.num_requests, admission.num_tokens) == (0, 0)
    config.max_queued_tokens = 2 * 3 + 2 * 10 - 1
    admission.admit(1, 1)
    with pytest.raises(APIError) as refusal:
        Generation("cmpl-c", plan, None, tokenizer, RouterMetrics("tiny"), admission).start()
    assert refusal.value.status == 429 and "adds 26" in refusal.value.message


def test_a_batch_past_the_queue_delay_is_refused_whole(tokenizer):
    async def run():
        client, _ = client_with("c", max_queue_delay_s=2.0)  # 100 tokens/s
        plan = _batch_plan([list(range(150)), list(range(100))], n=1)
        generation = Generation("cmpl-d", plan, client, tokenizer, RouterMetrics("tiny"))
        with pytest.raises(APIError) as refusal:
            generation.start()
        generation.close()
        return refusal.value, client

    refusal, client = asyncio.run(run())
    assert refusal.status == 429  # 150 + 100 tokens queued: 2.5 s at 100 tokens/s
    assert not client.inflight and len(client.prompt_queues) == 0
