"""`echo`, `max_tokens: 0` and `prompt_logprobs` in the router (router/api/echo.py): the prompt
echoed before the completion with its scores first (the first token's null), each prompt of a
batch its own, in the first chunk when streaming; max_tokens 0 only with echo, its one token
dropped; vLLM's prompt_logprobs shape; the checks, 400s naming the parameter; the formatter."""

from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.router.api.logprobs import LogprobFormatter, check_prompt_entries
from pdserve.wire.messages import TokenBatch, TokenUpdate, encode
from tests.router import test_streaming
from tests.router.test_streaming import REPLY, ScriptedNode, run_with_node, sse_payloads
from tests.router.test_validation import MODEL, assert_error
from tests.router.unlooped import node_stats, unlooped_router_config


def score(prompt: list[int], num_top: int) -> list[list]:
    """A made-up score per prompt token after the first, as a node sends them."""
    return [
        [token, -0.25 * position, position % 3 + 1, [[token, -0.25 * position], [7, -3.0]][:num_top]]
        for position, token in enumerate(prompt[1:], 1)
    ]


class ScoringNode(ScriptedNode):
    """REPLY's tokens, one per batch; the first carries the prompt's scores when asked."""

    malformed = False

    async def reply(self, message):
        ids = self.tokenizer.encode(REPLY)[: message.sampling.max_tokens]
        num_top = message.sampling.prompt_logprobs
        for i, token in enumerate(ids):
            await asyncio.sleep(self.delay)
            if message.request_id in self.aborted:
                return
            scores = None
            if i == 0 and num_top is not None:
                scores = score(message.prompt_token_ids, num_top)
                if self.malformed:
                    scores[0][0] += 1
            logprobs = None
            if message.sampling.logprobs is not None:
                logprobs = [[token, -0.5, [[token, -0.5]]]]
            update = TokenUpdate(
                message.request_id, [token], "length" if i == len(ids) - 1 else None,
                len(message.prompt_token_ids), logprobs, offset=i, prompt_logprobs=scores,
            )
            await self.push.send(encode(TokenBatch("n0", [update])))


@pytest.fixture
def scoring(monkeypatch):
    monkeypatch.setattr(test_streaming, "ScriptedNode", ScoringNode)


def post(tmp_path, tokenizer, route="/v1/completions", **fields):
    async def scenario(http, node):
        body = {"model": MODEL, **fields}
        response = await http.post(route, json=body)
        for _ in range(50):
            if fields.get("max_tokens") != 0 or node.aborted or not node.generates:
                break
            await asyncio.sleep(0.01)
        return response, node

    return run_with_node(tmp_path, tokenizer, scenario)


def tokens_of(tokenizer, ids):
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_scores_alone(
    tmp_path, tokenizer, scoring
):
    prompt = "The cat"
    r, node = post(tmp_path, tokenizer, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(prompt)
    (sent,) = node.generates
    assert sent.sampling.max_tokens == 1 and sent.sampling.prompt_logprobs == 1
    data = r.json()
    (choice,) = data["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == tokens_of(tokenizer, ids)
    assert logprobs["token_logprobs"] == [None] + [-0.25 * p for p in range(1, len(ids))]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {logprobs["tokens"][1]: -0.25}  # cut to logprobs=1
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids))]
    assert "prompt_logprobs" not in choice  # not asked for
    assert data["usage"]["completion_tokens"] == 0
    assert data["usage"]["prompt_tokens"] == len(ids)


def test_echo_puts_the_prompt_and_its_scores_before_the_completion(tmp_path, tokenizer, scoring):
    r, _ = post(tmp_path, tokenizer, prompt="Hi", echo=True, logprobs=0, max_tokens=2)
    assert r.status_code == 200, r.text
    reply = tokenizer.encode(REPLY)[:2]
    ids = tokenizer.encode("Hi")
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi" + tokenizer.decode(reply)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == tokens_of(tokenizer, ids + reply)
    assert logprobs["token_logprobs"][: len(ids)] == [None] + [-0.25] * (len(ids) - 1)
    assert logprobs["token_logprobs"][len(ids) :] == [-0.5, -0.5]
    assert logprobs["text_offset"][len(ids)] == len("Hi")
    assert r.json()["usage"]["completion_tokens"] == 2


def test_echo_without_logprobs_sends_the_text_and_asks_no_scores(tmp_path, tokenizer, scoring):
    r, node = post(tmp_path, tokenizer, prompt="Hi", echo=True, max_tokens=1)
    assert r.json()["choices"][0]["text"] == "Hi" + tokenizer.decode(tokenizer.encode(REPLY)[:1])
    assert r.json()["choices"][0]["logprobs"] is None
    assert node.generates[0].sampling.prompt_logprobs is None


def test_streaming_echo_sends_the_prompt_in_the_first_chunk(tmp_path, tokenizer, scoring):
    r, _ = post(tmp_path, tokenizer, prompt="Hi", echo=True, logprobs=0, max_tokens=3, stream=True)
    assert r.status_code == 200, r.text
    chunks = sse_payloads(r.text)
    first = chunks[0]["choices"][0]
    ids = tokenizer.encode("Hi")
    assert first["text"].startswith("Hi")
    assert first["logprobs"]["token_logprobs"][: len(ids)] == [None] + [-0.25] * (len(ids) - 1)
    assert len(first["logprobs"]["tokens"]) == len(ids) + 1
    later = "".join(c["choices"][0]["text"] for c in chunks[1:])
    assert first["text"] + later == "Hi" + tokenizer.decode(tokenizer.encode(REPLY)[:3])


def test_streaming_max_tokens_0_is_one_chunk_with_the_prompt(tmp_path, tokenizer, scoring):
    r, _ = post(tmp_path, tokenizer, prompt="ab", echo=True, logprobs=1, max_tokens=0, stream=True)
    (chunk,) = sse_payloads(r.text)
    choice = chunk["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][0] is None


def test_each_prompt_of_a_batch_echoes_its_own(tmp_path, tokenizer, scoring):
    ids = tokenizer.encode("xy")
    r, _ = post(tmp_path, tokenizer, prompt=[ids, tokenizer.encode("zw")], echo=True, max_tokens=0)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [tokenizer.decode(ids, skip_special_tokens=False),
                     tokenizer.decode(tokenizer.encode("zw"), skip_special_tokens=False)]
    r, _ = post(tmp_path, tokenizer, prompt=["ab", "cd"], echo=True, max_tokens=0, n=2)
    assert [c["text"] for c in r.json()["choices"]] == ["ab", "ab", "cd", "cd"]


def test_prompt_logprobs_come_in_vllm_shape(tmp_path, tokenizer, scoring):
    r, node = post(tmp_path, tokenizer, prompt="abc", prompt_logprobs=2, max_tokens=1)
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("abc")
    assert node.generates[0].sampling.prompt_logprobs == 2
    choice = r.json()["choices"][0]
    assert choice["text"] == tokenizer.decode(tokenizer.encode(REPLY)[:1])  # no echo
    shaped = choice["prompt_logprobs"]
    assert len(shaped) == len(ids) and shaped[0] is None
    for position in range(1, len(ids)):
        entry = shaped[position]
        token = str(ids[position])
        assert next(iter(entry)) == token
        assert entry[token] == {
            "logprob": -0.25 * position,
            "rank": position % 3 + 1,
            "decoded_token": tokenizer.decode([ids[position]], skip_special_tokens=False),
        }
        assert entry["7"]["rank"] == 2 and entry["7"]["logprob"] == -3.0


def test_chat_prompt_logprobs_are_on_the_response(tmp_path, tokenizer, scoring):
    r, _ = post(
        tmp_path, tokenizer, "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}], prompt_logprobs=0, max_tokens=1,
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["prompt_logprobs"][0] is None and len(data["prompt_logprobs"]) > 2
    assert all(len(entry) == 1 for entry in data["prompt_logprobs"][1:])


def test_prompt_scores_that_do_not_fit_the_prompt_fail_the_request(
    tmp_path, tokenizer, scoring, monkeypatch
):
    monkeypatch.setattr(ScoringNode, "malformed", True)
    r, _ = post(tmp_path, tokenizer, prompt="abc", echo=True, logprobs=0, max_tokens=0)
    assert_error(r, 500)


@pytest.fixture
def client(tiny_llama_dir):
    from starlette.testclient import TestClient

    from pdserve.router.api.app import create_app

    config = unlooped_router_config(
        tiny_llama_dir,
        MODEL,
        node_timeout_s=30.0,  # one NodeStats and no heartbeats: the timeout must hold
    )
    app = create_app(config)
    app.state.router.client.record_stats(node_stats())
    return TestClient(app)


REFUSED = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ({"echo": 1}, "echo"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_echo_and_prompt_logprobs_rules_are_400_naming_the_parameter(client, fields, param):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", **fields})
    assert_error(r, 400, param)


def test_echo_is_refused_on_chat(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "echo": True}
    assert_error(client.post("/v1/chat/completions", json=body), 400, "echo")


def test_the_formatter_clamps_minus_infinity_and_nulls_the_first_token(tokenizer):
    formatter = LogprobFormatter(tokenizer)
    prompt = [5, 6, 7]
    entries = [[6, -math.inf, 9, [[1, -0.1]]], [7, -1.0, 1, [[7, -1.0], [6, -2.0]]]]
    echoed = formatter.echoed_prompt(prompt, entries, 1)
    assert echoed["token_logprobs"] == [None, -9999.0, -1.0]
    assert echoed["top_logprobs"][0] is None and len(echoed["top_logprobs"][2]) == 1
    shaped = formatter.prompt_logprobs(prompt, entries)
    assert shaped[0] is None and list(shaped[1]) == ["6", "1"]
    assert list(shaped[2]) == ["7", "6"] and shaped[2]["7"]["rank"] == 1


@pytest.mark.parametrize(
    "entries",
    [
        None,
        [],
        [[6, -1.0, 1, []]],
        [[6, -1.0, 1, []], [8, -1.0, 1, []]],
        [[6, "x", 1, []], [7, -1.0, 1, []]],
        [[6, -1.0, 0, []], [7, -1.0, 1, []]],
        [[6, -1.0, 1, [[1]]], [7, -1.0, 1, []]],
        [[6, -1.0, 1, [[1, -1.0]] * 21], [7, -1.0, 1, []]],
        [[6, math.nan, 1, []], [7, -1.0, 1, []]],
    ],
)
def test_prompt_scores_are_checked_against_the_prompt(entries):
    assert not check_prompt_entries(entries, [5, 6, 7])
    assert check_prompt_entries([[6, -1.0, 1, []], [7, -1, 2, [[3, -0.5]]]], [5, 6, 7])
