"""Tool calls, the request side: `tools` and `tool_choice` bounded with 400s naming the field,
the spec that forces a call per `tool_choice`, the history's calls and tool messages accepted,
and what the chat template gets: the tools in its `tools` variable where it reads them, in a
system message pdserve adds where it does not."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from pdserve.router.api.app import create_app
from pdserve.router.api.schemas import ChatCompletionRequest
from pdserve.router.api.tools import (
    MAX_TOOLS,
    NO_PARAMETERS,
    TOOLS_INSTRUCTION,
    ToolMode,
    call_schema,
    check_tools,
    forced_spec,
    template_input,
)
from pdserve.router.api.validation import plan_chat
from pdserve.router.config import RouterConfig
from pdserve.text.tokenizer import load_tokenizer
from tests.router.unlooped import unlooped_router_config
from tests.text.test_chat_template_tools import HERMES_TEMPLATE, PLAIN_TEMPLATE
from tests.text.test_detokenizer import byte_level_tokenizer
from tests.text.test_tokenizer import save_folder

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}


def tool(name: str, parameters: dict | None = None, **function) -> dict:
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": {"name": name, **function}}


TOOLS = [tool("get_weather", WEATHER, description="Weather in a city."), tool("now")]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    config = unlooped_router_config(tiny_llama_dir, MODEL)
    return TestClient(create_app(config))


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})


BAD = [
    ({"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": [tool("f", description="d" * 70_000)]}, "tools"),
    ({"tools": [*TOOLS, tool("ok"), tool("bad name!")]}, "tools[3].function.name"),
    ({"tools": [tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [tool("f"), tool("f")]}, "tools[1].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [tool("f", [1, 2])]}, "tools[0].function.parameters"),
    ({"tools": [tool("f", description=5)]}, "tools[0].function.description"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"messages": [{"role": "tool", "content": "1", "tool_calls": "x"}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tools_and_tool_choice_are_400_naming_the_field(client, fields, param):
    r = chat(client, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


GOOD = [
    {"tools": TOOLS},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "none"},
    {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}},
    {"tools": TOOLS, "messages": HISTORY},
    {"tool_choice": "auto"},
    {"tools": TOOLS, "response_format": {"type": "json_object"}},  # auto: the format wins
]


@pytest.mark.parametrize("fields", GOOD)
def test_tools_tool_choice_and_tool_history_pass_validation(client, fields):
    assert chat(client, **fields).status_code == 503, chat(client, **fields).text  # no node


def test_tool_choice_none_or_no_tools_plans_no_tool_calls():
    assert check_tools(request(tools=TOOLS, tool_choice="none")) is None
    assert check_tools(request(tool_choice="auto")) is None
    assert check_tools(request()) is None
    plan = check_tools(request(tools=TOOLS))
    assert plan.mode is ToolMode.AUTO and plan.names == {"get_weather", "now"}
    assert forced_spec(plan) is None


def test_a_named_function_is_forced_to_its_arguments():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = check_tools(request(tools=TOOLS, tool_choice=choice))
    assert plan.mode is ToolMode.NAMED and plan.named == "get_weather"
    assert forced_spec(plan) == {"json_schema": WEATHER}
    now = {"type": "function", "function": {"name": "now"}}
    no_parameters = check_tools(request(tools=TOOLS, tool_choice=now))
    assert forced_spec(no_parameters) == {"json_schema": NO_PARAMETERS}


def test_required_is_forced_to_a_list_of_calls_or_one_call():
    parallel = forced_spec(check_tools(request(tools=TOOLS, tool_choice="required")))
    calls = [call_schema("get_weather", WEATHER), call_schema("now", NO_PARAMETERS)]
    assert parallel == {
        "json_schema": {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    }
    single = check_tools(
        request(tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)
    )
    schema = forced_spec(single)["json_schema"]
    assert schema == call_schema("get_weather", WEATHER)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["required"] == ["name", "arguments"] and not schema["additionalProperties"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    def folder(name, template):
        path = tmp_path_factory.mktemp(name)
        return load_tokenizer(save_folder(byte_level_tokenizer(), path, chat_template=template))

    return {"hermes": folder("hermes", HERMES_TEMPLATE), "plain": folder("plain", PLAIN_TEMPLATE)}


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_they_are(tokenizers):
    req = request(tools=TOOLS, messages=HISTORY)
    messages, tools = template_input(req.messages, check_tools(req), tokenizers["hermes"])
    assert [t["function"]["name"] for t in tools] == ["get_weather", "now"]
    assert messages[0] == USER[0]  # no system message added
    call = messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


def test_a_template_without_tools_gets_them_in_a_system_message(tokenizers):
    req = request(tools=TOOLS, messages=HISTORY)
    messages, tools = template_input(req.messages, check_tools(req), tokenizers["plain"])
    assert tools is None
    system = messages[0]
    assert system["role"] == "system" and system["content"].startswith(TOOLS_INSTRUCTION)
    lines = system["content"].splitlines()[1:]
    assert [json.loads(line)["name"] for line in lines] == ["get_weather", "now"]
    assert json.loads(lines[0])["parameters"] == WEATHER
    assert messages[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    with_system = request(tools=TOOLS, messages=[{"role": "system", "content": "Be brief."}, *USER])
    plan = check_tools(with_system)
    messages, _ = template_input(with_system.messages, plan, tokenizers["plain"])
    assert messages[0]["content"].startswith("Be brief.\n\n" + TOOLS_INSTRUCTION)
    assert len(messages) == 2


def test_tool_choice_none_shows_no_tools(tokenizers):
    req = request(tools=TOOLS, tool_choice="none")
    messages, tools = template_input(req.messages, check_tools(req), tokenizers["plain"])
    assert tools is None and messages == USER


def test_a_planned_chat_sends_the_forced_spec_and_renders_the_tools(tiny_llama_dir, tokenizers):
    config = RouterConfig(model_path=tiny_llama_dir, served_model_name=MODEL)
    req = request(tools=TOOLS, tool_choice="required", n=2, max_tokens=5)
    plan = plan_chat(req, config, tokenizers["hermes"], lambda: (4096, 512))
    assert plan.tools.mode is ToolMode.REQUIRED
    assert all(s.structured_output["json_schema"]["type"] == "array" for s in plan.samplings)
    prompt = tokenizers["hermes"].decode(plan.prompts[0])
    assert "# Tools" in prompt and '"description": "Weather in a city."' in prompt
    plain = plan_chat(request(max_tokens=5), config, tokenizers["hermes"], lambda: (4096, 512))
    assert plain.tools is None and plain.samplings[0].structured_output is None
