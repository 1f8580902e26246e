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


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


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

BATCH = ["The capital of France is", "One, two, three,"]


def _greedy(client, model_name, prompt, **params) -> list[str]:
    out = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True}, **params,
    )
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_batched_string_prompts_answer_each_prompt_n_times_in_order(
    client, model_name, default_model_dir
):
    tokenizer = load_tokenizer(default_model_dir)
    solo = [_greedy(client, model_name, prompt)[0] for prompt in BATCH]
    out = client.completions.create(
        model=model_name, prompt=BATCH, n=2, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )
    by_index = {c.index: c.text for c in out.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert [by_index[i] for i in range(4)] == [solo[0], solo[0], solo[1], solo[1]]
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in BATCH)
    assert out.usage.completion_tokens == 4 * 6


def test_batched_token_prompts_stream_every_index(client, model_name, default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(p) for p in BATCH]
    solo = [_greedy(client, model_name, ids)[0] for ids in prompts]
    stream = client.completions.create(
        model=model_name, prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == [solo[0], solo[0], solo[1], solo[1]]
    assert usage.prompt_tokens == sum(len(p) for p in prompts)
    assert usage.completion_tokens == 4 * 6


def test_a_parameter_that_is_not_implemented_is_a_bad_request_naming_it(client, model_name):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                  suffix=" the end")
    assert refused.value.param == "suffix"
    assert "not supported" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"functions": [{"name": "f", "parameters": {}}]},
        )
    assert refused.value.param == "functions"
    neutral = client.completions.create(model=model_name, prompt="Hi", max_tokens=2,
                                        presence_penalty=0, frequency_penalty=0)
    assert neutral.choices[0].finish_reason == "length"


def test_models_retrieve_finds_the_served_model_and_404s_others(client, model_name):
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tokenize_and_detokenize_round_trip_the_tokenizer(server, model_name, default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    text = "Tokenize me, please."
    out = httpx.post(f"{server}/tokenize", json={"model": model_name, "prompt": text}, timeout=30)
    assert out.status_code == 200, out.text
    data = out.json()
    assert data["tokens"] == tokenizer.encode(text) and data["count"] == len(data["tokens"])
    assert data["max_model_len"] > 0
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{server}/tokenize", json={"model": model_name, "messages": messages,
                                                  "add_generation_prompt": True}, timeout=30)
    assert chat.json()["tokens"] == tokenizer.apply_chat_template(messages)
    back = httpx.post(f"{server}/detokenize", json={"model": model_name,
                                                    "tokens": data["tokens"]}, timeout=30)
    assert back.json() == {"prompt": tokenizer.decode(data["tokens"])}
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_logit_bias_forces_a_token_and_stop_token_ids_end_the_text(
    client, model_name, default_model_dir
):
    tokenizer = load_tokenizer(default_model_dir)
    (forced,) = tokenizer.encode(" Paris", add_special_tokens=False)
    params = {"model": model_name, "prompt": "My favourite word is", "temperature": 0}
    biased = client.completions.create(
        **params, max_tokens=3, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}
    )
    assert biased.choices[0].text == tokenizer.decode([forced] * 3)
    free = client.completions.create(**params, max_tokens=6, extra_body={"ignore_eos": True})
    free_ids = tokenizer.encode(free.choices[0].text, add_special_tokens=False)
    stopped = client.completions.create(
        **params, max_tokens=6, extra_body={"stop_token_ids": [free_ids[1]]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 2


def test_penalties_change_greedy_text_and_repeat_less(client, model_name):
    params = {
        "model": model_name,
        "prompt": "List the numbers: one, one, one, one, one,",
        "temperature": 0,
        "max_tokens": 24,
        "extra_body": {"ignore_eos": True},
    }
    plain = client.completions.create(**params).choices[0].text
    penalized = client.completions.create(
        **params, frequency_penalty=2.0, presence_penalty=1.0
    ).choices[0].text
    repeated = client.completions.create(**{**params, "extra_body": {
        "ignore_eos": True, "repetition_penalty": 1.3}}).choices[0].text
    assert penalized != plain and repeated != plain
    assert len(set(penalized.split())) >= len(set(plain.split()))


def _prompt_scores(client, model_name, prompt, **fields):
    """`echo` with `logprobs` and `max_tokens: 0`, as lm-eval's loglikelihood requests."""
    return client.completions.create(
        model=model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0,
        **fields,
    )


def test_echo_with_max_tokens_0_scores_the_prompt_like_transformers(
    client, model_name, default_model_dir
):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps over the lazy dog."
    ids = load_tokenizer(default_model_dir).encode(prompt)
    first = _prompt_scores(client, model_name, prompt)
    choice = first.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert first.usage.prompt_tokens == len(ids) and first.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and "".join(logprobs.tokens) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scores = logprobs.token_logprobs[1:]
    assert all(s < 0 and s > -100 for s in scores)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    log_likelihood = expected.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert abs(sum(scores) - log_likelihood) < 1e-2 * len(scores)
    again = _prompt_scores(client, model_name, prompt)  # its blocks are in the prefix caches now
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs)
    stream = _prompt_scores(client, model_name, prompt, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[0].text == prompt and chunks[0].logprobs.token_logprobs[0] is None
    assert chunks[-1].finish_reason == "length"


def test_summed_continuation_logprobs_rank_the_right_answer_first(
    client, model_name, default_model_dir
):
    context = "The capital of France is"
    continuations = [" Paris", " banana"]
    num_context = len(load_tokenizer(default_model_dir).encode(context))
    batch = _prompt_scores(client, model_name, [context + c for c in continuations])
    totals = [sum(c.logprobs.token_logprobs[num_context:]) for c in batch.choices]
    assert [c.text for c in batch.choices] == [context + c for c in continuations]
    assert totals[0] > totals[1], totals
    greedy = [
        c.logprobs.token_logprobs[num_context] == max(c.logprobs.top_logprobs[num_context].values())
        for c in batch.choices
    ]
    assert greedy == [True, False]


def test_prompt_logprobs_come_in_vllms_shape(client, model_name):
    completion = client.completions.create(
        model=model_name, prompt="Hello there", max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    shaped = completion.choices[0].model_extra["prompt_logprobs"]
    assert shaped[0] is None and len(shaped) >= 2
    for position in shaped[1:]:
        assert 2 <= len(position) <= 3
        assert {entry["rank"] for entry in position.values()} >= {1, 2}
        assert all(entry["logprob"] <= 0 for entry in position.values())
