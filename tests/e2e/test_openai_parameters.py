"""End to end, the request parameters beyond plain generation, through the openai client against
`pdserve serve` on the default model: batched prompts, tokenize/detokenize, logit_bias and
stop_token_ids, penalties, echo and prompt scoring, prompt_logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def server(pdserve_server):
    return pdserve_server


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
