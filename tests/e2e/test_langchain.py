"""End to end: LangChain's `ChatOpenAI` (langchain-openai) against `pdserve serve
--reasoning-parser qwen3` on a tiny random-weight Qwen3 with a Qwen3-style chat template
(conftest.py's `qwen3_reasoning_server`), greedy.

`enable_thinking` travels as LangChain users send it, in
`extra_body={"chat_template_kwargs": {...}}`, and reaches the template. An answer made to think
(a `guided_regex` in `extra_body`, as in test_reasoning.py) comes back split: ChatOpenAI puts
only the answer in `content`, whole and streamed alike, never a `<think>` tag. ChatOpenAI 1.8
follows OpenAI's own API and drops the non-standard `reasoning_content` field (its module
docstring says so; provider packages such as ChatDeepSeek read it): the thinking is visible to
LangChain only as output tokens in `usage_metadata`, and the openai client shows it is there.
A tool forced by `bind_tools(..., tool_choice=name)` comes back as a parsed `tool_calls` entry
(pdserve constrains the output to the function's parameters), and its result goes back in a
`ToolMessage` for a second turn."""

from __future__ import annotations

import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from tests.e2e.qwen3_thinking import MESSAGES, THINK_THEN_ANSWER

QUESTION = MESSAGES[0]["content"]
FORCED = {"guided_regex": THINK_THEN_ANSWER}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "London"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def openai_client(qwen3_reasoning_server):
    return openai.OpenAI(base_url=f"{qwen3_reasoning_server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_model(qwen3_reasoning_server, openai_client):
    """ChatOpenAI(**options) pointed at the server, greedy."""

    def made(**options) -> ChatOpenAI:
        return ChatOpenAI(
            model=openai_client.models.list().data[0].id,
            base_url=f"{qwen3_reasoning_server}/v1",
            api_key="unused",
            temperature=0,
            max_retries=0,
            **{"max_tokens": 32, **options},
        )

    return made


def test_enable_thinking_in_extra_body_reaches_the_template(chat_model):
    def prompt_tokens(enable_thinking: bool) -> int:
        model = chat_model(max_tokens=1, extra_body={
            "chat_template_kwargs": {"enable_thinking": enable_thinking}
        })
        return model.invoke(QUESTION).usage_metadata["input_tokens"]

    added = len("<think>\n\n</think>\n\n")  # one token per byte
    assert prompt_tokens(False) == prompt_tokens(True) + added


def test_thinking_stays_out_of_the_content_whole_and_streamed(chat_model, openai_client):
    model = chat_model(extra_body=FORCED)
    whole = model.invoke(QUESTION)
    raw = openai_client.chat.completions.create(
        model=model.model_name, messages=MESSAGES, max_tokens=32, temperature=0, extra_body=FORCED
    ).choices[0].message
    reasoning = raw.model_extra["reasoning_content"]
    assert reasoning.isalpha() and 4 <= len(reasoning) <= 8
    assert whole.content == raw.content
    assert whole.content.isalpha() and "<think>" not in whole.content
    assert whole.additional_kwargs.get("reasoning_content", reasoning) == reasoning
    thinking_tags = len("<think></think>\n\n")
    assert whole.usage_metadata["output_tokens"] == (
        thinking_tags + len(reasoning) + len(whole.content)
    )
    chunks = list(model.stream(QUESTION))
    assert not any("<think>" in chunk.content for chunk in chunks)
    assert "".join(chunk.content for chunk in chunks) == whole.content


def test_a_forced_tool_call_round_trips(chat_model):
    question = HumanMessage("What is the weather like in Paris?")
    call_message = chat_model(max_tokens=64).bind_tools(
        [WEATHER], tool_choice="get_weather"
    ).invoke([question])
    assert call_message.response_metadata["finish_reason"] == "tool_calls"
    [call] = call_message.tool_calls
    assert call["name"] == "get_weather"
    assert call["args"]["city"] in ("Paris", "London")
    assert call["args"]["unit"] in ("celsius", "fahrenheit")
    result = ToolMessage(content='{"temperature": 21}', tool_call_id=call["id"])
    answer = chat_model(max_tokens=4).bind_tools([WEATHER]).invoke(
        [question, call_message, result]
    )
    assert answer.usage_metadata["output_tokens"] > 0
    grown = answer.usage_metadata["input_tokens"] - call_message.usage_metadata["input_tokens"]
    assert grown >= len(result.content)  # the history holds the tool's result
