"""Tool calls, the request side: OpenAI's `tools` and `tool_choice` checked and bounded, the
tools and the history's calls put in the chat template, and the grammar that forces a call.

What each `tool_choice` does (router/api/tool_output.py turns the output into `tool_calls`):

  none, or no tools    the tools are neither shown to the model nor parsed: a plain answer.
  auto (the default    the tools are shown; the model answers freely; Hermes-style calls,
  with tools)          `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, are parsed
                       out of its text (router/api/tool_parser.py), the rest stays content.
  required             forced by a json_schema: a list of one or more calls, each
                       `{"name": <one of the tools>, "arguments": <its parameters>}`
                       (one call, no list, with `parallel_tool_calls: false`).
  {"type": "function", forced by a json_schema: the output is that function's arguments,
   "function": {name}} valid against its parameters.

The tools reach the model through the template's `tools` variable (Qwen2.5, Qwen3, Llama 3.1
and most tool-calling templates read it). A template that never names `tools` (the default
model's) gets them in a system message instead (`tools_prompt`): a fixed text, the Hermes
format for `auto`, and the functions as JSON; and when it never names `tool_calls`, the
history's assistant calls are written into its content in that same format.

Bounds (400 naming the field, `tools[3].function.name`): at most MAX_TOOLS tools, at most
MAX_TOOLS_JSON_CHARS characters of them as JSON, names as OpenAI's `^[a-zA-Z0-9_-]{1,64}$`,
each distinct, parameters a JSON schema object within wire/structured_output.py's bounds.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.router.api.schemas import ChatCompletionRequest, ChatMessage
from pdserve.router.errors import invalid
from pdserve.wire.structured_output import check_structured_output

MAX_TOOLS = 128
MAX_TOOLS_JSON_CHARS = 64 * 1024
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOLS_INSTRUCTION = (
    "You can call the functions below. To call one, answer with "
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}'
    "</tool_call>, one such tag per call; otherwise answer as usual."
)
FORCED_INSTRUCTION = "You call the functions below, given as JSON schemas."


class ToolMode(enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools (normalized OpenAI function maps) and what `tool_choice` asks."""

    tools: tuple[dict[str, Any], ...]
    mode: ToolMode
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def forced(self) -> bool:
        return self.mode is not ToolMode.AUTO

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"]["parameters"]
        raise KeyError(name)


def check_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan, or None when no tool may be called; 400 naming the field."""
    tools = _checked_tools(req.tools or [])
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise invalid(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        if not tools:
            if choice == "auto":
                return None
            raise invalid("'tool_choice' 'required' needs 'tools'.", "tool_choice")
        mode, named = ToolMode(choice), None
    else:
        named = _named_choice(choice, tools)
        mode = ToolMode.NAMED
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(tuple(tools), mode, named, parallel)


def _named_choice(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise invalid(
            '\'tool_choice\' as an object must be {"type": "function", "function": {"name"}}.',
            "tool_choice",
        )
    name = function.get("name")
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise invalid(
            "'tool_choice.function.name' must name one of the functions in 'tools'.",
            "tool_choice.function.name",
        )
    return name


def _checked_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise invalid(f"'tools' may hold at most {MAX_TOOLS} functions.", "tools")
    try:
        size = len(json.dumps(tools, ensure_ascii=False, allow_nan=False))
    except ValueError:
        raise invalid(
            "'tools' holds NaN or an infinity, which JSON cannot hold.", "tools"
        ) from None
    if size > MAX_TOOLS_JSON_CHARS:
        raise invalid(
            f"'tools' must be at most {MAX_TOOLS_JSON_CHARS:,} characters as JSON.", "tools"
        )
    out, seen = [], set()
    for index, tool in enumerate(tools):
        normalized = _checked_tool(tool, f"tools[{index}]")
        name = normalized["function"]["name"]
        if name in seen:
            raise invalid(
                f"'tools[{index}].function.name' repeats the name of an earlier function.",
                f"tools[{index}].function.name",
            )
        seen.add(name)
        out.append(normalized)
    return out


def _checked_tool(tool: Any, field: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f"'{field}.type' must be 'function'.", f"{field}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"'{field}.function' must be an object.", f"{field}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            f"'{field}.function.name' must be 1 to 64 letters, digits, underscores or dashes.",
            f"{field}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(
            f"'{field}.function.description' must be a string.", f"{field}.function.description"
        )
    if function.get("strict") not in (None, True, False):
        raise invalid(f"'{field}.function.strict' must be a boolean.", f"{field}.function.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    try:
        check_structured_output({"json_schema": parameters})
    except ValueError as error:
        param = f"{field}.function.parameters"
        message = str(error).replace("structured_output.json_schema", param, 1)
        raise invalid(f"{message}.", param) from None
    normalized = {"name": name, "parameters": parameters}
    if description is not None:
        normalized["description"] = description
    return {"type": "function", "function": normalized}


# -- the grammar of a forced call ------------------------------------------------------------


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_spec(plan: ToolPlan) -> dict[str, Any] | None:
    """The structured_output spec that forces the call(s), or None for `auto`."""
    if plan.mode is ToolMode.AUTO:
        return None
    if plan.mode is ToolMode.NAMED:
        schema = plan.parameters(plan.named)
    else:
        calls = [
            call_schema(t["function"]["name"], t["function"]["parameters"]) for t in plan.tools
        ]
        one_call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one_call, "minItems": 1} if plan.parallel else one_call
    try:
        return check_structured_output({"json_schema": schema})
    except ValueError as error:
        raise invalid(
            f"the tools' parameters are too large to force a call: {error}.", "tools"
        ) from None


# -- the template's input --------------------------------------------------------------------


def template_input(
    messages: list[ChatMessage], plan: ToolPlan | None, tokenizer: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the chat template renders (module docstring)."""
    reads_tools = tokenizer.template_reads("tools")
    reads_calls = tokenizer.template_reads("tool_calls")
    out = [_template_message(m, reads_calls) for m in messages]
    if plan is None:
        return out, None
    tools = [dict(tool) for tool in plan.tools]
    if reads_tools:
        return out, tools
    prompt = tools_prompt(plan)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def tools_prompt(plan: ToolPlan) -> str:
    """The system text that shows a template without `tools` the functions."""
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    instruction = FORCED_INSTRUCTION if plan.forced else TOOLS_INSTRUCTION
    return f"{instruction}\n{functions}"


def _template_message(message: ChatMessage, reads_calls: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.role == "tool":
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
    if not message.tool_calls:
        return out
    if not reads_calls:
        tags = "".join(
            f"<tool_call>{hermes_call(c.function.name, c.function.arguments)}</tool_call>"
            for c in message.tool_calls
        )
        out["content"] = f"{out['content']}{tags}"
        return out
    out["tool_calls"] = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": _arguments(call)},
        }
        for call in message.tool_calls
    ]
    return out


def _arguments(call: Any) -> Any:
    """Arguments as a map, as Hugging Face templates expect them (`arguments | tojson`);
    text that is no JSON object stays text."""
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


def hermes_call(name: str, arguments: str) -> str:
    """One call as Hermes writes it inside `<tool_call>` tags (arguments as JSON text)."""
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}'
