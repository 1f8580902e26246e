"""Tools in the chat template: `apply_chat_template(messages, tools=...)` renders the template's
`tools` variable, assistant `tool_calls` and `tool` messages as transformers does for the same
folder (a Hermes-style template, Qwen2.5's in short), and `template_reads` tells a template that
knows tools from one that does not."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.text.tokenizer import load_tokenizer
from tests.text.test_detokenizer import byte_level_tokenizer
from tests.text.test_tokenizer import save_folder

# Qwen2.5's template, shortened: tools as JSON lines in the system turn, calls in <tool_call>
# tags, tool results as a user turn of <tool_response> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22 C, cloudy"},
]


@pytest.fixture(scope="module")
def hermes_pair(tmp_path_factory):
    folder = save_folder(
        byte_level_tokenizer(), tmp_path_factory.mktemp("hermes"), chat_template=HERMES_TEMPLATE
    )
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_tools_and_tool_calls_render_as_transformers_renders_them(hermes_pair, tools):
    ours, theirs = hermes_pair
    text = theirs.apply_chat_template(
        HISTORY, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert ours.apply_chat_template(HISTORY, tools=tools) == theirs.encode(
        text, add_special_tokens=False
    )
    assert ("The weather in a city." in text) == (tools is not None)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


def test_template_reads_tells_a_tool_template_from_a_plain_one(hermes_pair, tmp_path):
    ours, _ = hermes_pair
    assert ours.template_reads("tools") and ours.template_reads("tool_calls")
    folder = save_folder(byte_level_tokenizer(), tmp_path, chat_template=PLAIN_TEMPLATE)
    plain = load_tokenizer(folder)
    assert not plain.template_reads("tools") and not plain.template_reads("tool_calls")
    # a plain template ignores the tools it is given
    messages = [{"role": "user", "content": "hi"}]
    assert plain.apply_chat_template(messages, tools=TOOLS) == plain.apply_chat_template(messages)


@pytest.mark.default_model
def test_the_default_model_template_does_not_read_tools(default_model_dir):
    assert not load_tokenizer(default_model_dir).template_reads("tools")
