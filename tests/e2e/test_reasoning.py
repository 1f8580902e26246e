"""End to end: a Qwen3-family model (tiny, random weights) behind `pdserve serve
--reasoning-parser qwen3`, with a Qwen3-style chat template, asked through the openai client.

`chat_template_kwargs: {"enable_thinking": false}` reaches the template (the prompt grows by its
empty thinking block); an answer that thinks comes back with its thinking in
`reasoning_content` and the rest in `content`, whole and streamed. Random weights think only
when made to: a `guided_regex` forces the output's shape, the parser's job is the split."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.qwen3_thinking import MESSAGES, THINK_THEN_ANSWER


@pytest.fixture(scope="module")
def client(qwen3_reasoning_server):
    return openai.OpenAI(base_url=f"{qwen3_reasoning_server}/v1", api_key="unused", max_retries=0)


def ask(client, **extra):
    request = {"messages": MESSAGES, "max_tokens": 32, "temperature": 0, **extra}
    return client.chat.completions.create(model=client.models.list().data[0].id, **request)


def test_enable_thinking_reaches_the_template(client):
    thinking = ask(client, max_tokens=1)
    not_thinking = ask(client, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}
    })
    added = len("<think>\n\n</think>\n\n")  # one token per byte
    assert not_thinking.usage.prompt_tokens == thinking.usage.prompt_tokens + added


def test_thinking_comes_back_as_reasoning_content_whole_and_streamed(client):
    forced = {"guided_regex": THINK_THEN_ANSWER}
    message = ask(client, extra_body=forced).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.isalpha() and 4 <= len(reasoning) <= 8
    assert message.content.isalpha() and "think" not in message.content
    chunks = list(ask(client, extra_body=forced, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (
        reasoning
    )
    assert "".join(d.content or "" for d in deltas) == message.content
