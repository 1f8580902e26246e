"""End to end: `pdserve serve` (router + colocated node, real processes) and the openai client."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.text.tokenizer import load_tokenizer
from tests.fault_checks import assert_no_leaked_blocks, wait_until, wait_until_async

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def server(pdserve_server):
    return pdserve_server


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def stream_text(stream) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text.append((delta.content or "") if delta is not None else choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_streamed_chat_on_the_default_model_mentions_paris(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
        stream=True,
    )
    text, finish = stream_text(stream)
    assert "Paris" in text
    assert finish == "stop"


def test_streamed_and_plain_greedy_text_are_identical(client, model_name):
    params = {"model": model_name, "prompt": "The history of the printing press", "max_tokens": 40,
                  "temperature": 0}
    plain = client.completions.create(**params)
    streamed, finish = stream_text(client.completions.create(**params, stream=True))
    assert plain.choices[0].text == streamed
    assert plain.choices[0].finish_reason == finish == "length"


def test_usage_counts_prompt_and_completion_tokens(client, model_name, default_model_dir):
    messages = [{"role": "user", "content": "Name three colours."}]
    out = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = load_tokenizer(default_model_dir).apply_chat_template(messages)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(prompt_ids) + 12
    assert out.choices[0].finish_reason == "length"


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache(server, client, model_name):
    document = " ".join(f"Clause {i}: the tenant keeps the garden tidy." for i in range(30))
    messages = [{"role": "system", "content": document},
                {"role": "user", "content": "Summarize clause 7."}]
    hits_before = metric(server, "pdserve_prefix_cache_hits_total")
    first, second = (
        client.chat.completions.create(
            model=model_name, messages=messages, temperature=0, max_tokens=8
        )
        for _ in range(2)
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.usage.prompt_tokens - 16 <= cached < second.usage.prompt_tokens
    assert cached % 16 == 0
    wait_until(
        lambda: metric(server, "pdserve_prefix_cache_hits_total") >= hits_before + cached,
        30,
        "the node's cache hits reaching /metrics",
    )


def test_n_choices_equal_lone_requests_with_seed_plus_i_and_compute_the_prompt_once(
    server, client, model_name
):
    prompt = f"Ticket {uuid.uuid4().hex}: the printer on floor three"  # no cached prefix
    params = {"model": model_name, "max_tokens": 12, "temperature": 1.0, "seed": 2024}
    computed = "pdserve_prompt_tokens_computed_total"
    before = metric(server, computed)
    out = client.completions.create(prompt=prompt, n=4, **params)
    wait_until(
        lambda: metric(server, computed) >= before + out.usage.prompt_tokens, 30,
        "the prompt tokens computed reaching /metrics",
    )
    time.sleep(1.5)  # every node's next NodeStats: nothing more was computed
    assert metric(server, computed) == before + out.usage.prompt_tokens
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    lone = [
        client.completions.create(prompt=prompt, **{**params, "seed": 2024 + i}).choices[0].text
        for i in range(4)
    ]
    assert texts == lone
    assert len(set(texts)) > 1


def test_sixteen_concurrent_streams_match_their_solo_text(server, model_name):
    prompts = ["Once upon a time", "The best way to learn", "In 1969,", "def add(a, b):"]
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)

    async def run(prompt: str) -> str:
        stream = await client.completions.create(
            model=model_name, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        solo = [await run(p) for p in prompts]
        together = await asyncio.gather(*(run(p) for p in prompts * 4))
        return solo, together

    solo, together = asyncio.run(main())
    assert together == solo * 4


def test_disconnected_streams_are_aborted_and_free_their_blocks(pdserve_process, model_name):
    server = pdserve_process.url
    body = {"model": model_name, "prompt": "Write a long story about a ship.", "max_tokens": 160,
            "temperature": 0, "ignore_eos": True, "stream": True}
    logged_before = len(pdserve_process.log_path.read_text(errors="replace"))

    def aborts_logged() -> int:  # by the node that held each request ("aborted request <id>")
        return pdserve_process.log_path.read_text(errors="replace")[logged_before:].count(
            "aborted request "
        )

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            async def open_stream():
                response = await http.send(
                    http.build_request("POST", "/v1/completions", json=body), stream=True
                )
                lines = response.aiter_lines()
                while "data:" not in await anext(lines):
                    pass
                return response, lines

            streams = await asyncio.gather(*(open_stream() for _ in range(8)))
            for response, _ in streams[:4]:
                await response.aclose()
            await wait_until_async(lambda: aborts_logged() >= 4, 60, "four aborts reaching nodes")
            for response, lines in streams[4:]:
                async for _ in lines:
                    pass
                await response.aclose()

    asyncio.run(main())
    assert aborts_logged() == 4, "a stream that was read to its end was aborted"
    assert_no_leaked_blocks(server)


BAD_BODIES = [
    ({"max_tokens": 0}, 400),
    ({"temperature": -1}, 400),
    ({"top_p": 0}, 400),
    ({"top_p": 1.5}, 400),
    ({"n": 1000}, 400),
    ({"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]}, 400),
    ({"logprobs": 50}, 400),
    ({"prompt": [1, 2, 10_000_000]}, 400),
    ({"max_tokens": "many"}, 400),
    ({"prompt": "hi " * 9000, "max_tokens": 100}, 400),
    ({"model": "no-such-model"}, 404),
]


@pytest.mark.parametrize(("override", "status"), BAD_BODIES)
def test_bad_completion_input_gets_an_openai_error_and_the_server_keeps_serving(
    server, model_name, override, status
):
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 4, **override}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if status == 400 and str(override.get("prompt", "")).startswith("hi "):
        assert "maximum context length" in error["message"]
    ok = httpx.post(
        f"{server}/v1/completions",
        json={"model": model_name, "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": []}, 400),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
        ({"messages": "hello"}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30,
          "logprobs": True}, 400),
    ],
)
def test_bad_chat_input_gets_an_openai_error(server, model_name, body, status):
    response = httpx.post(
        f"{server}/v1/chat/completions", json={"model": model_name, **body}, timeout=30
    )
    assert response.status_code == status
    assert "message" in response.json()["error"]


def test_malformed_json_and_oversized_bodies_are_rejected(server):
    bad_json = httpx.post(
        f"{server}/v1/completions", content=b"{not json", timeout=10,
        headers={"content-type": "application/json"},
    )
    assert bad_json.status_code == 400
    bad_utf8 = httpx.post(
        f"{server}/v1/completions", content=b'{"prompt": "\xff\xfe"}', timeout=10,
        headers={"content-type": "application/json"},
    )
    assert bad_utf8.status_code == 400
    huge = httpx.post(
        f"{server}/v1/completions", content=b"{" + b" " * (8 << 20) + b"}", timeout=30,
        headers={"content-type": "application/json"},
    )
    assert huge.status_code == 413


# -- API fidelity: batched prompts, refused parameters, models/{id}, tokenize --------------
