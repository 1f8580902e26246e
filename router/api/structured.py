"""Structured output as the API asks for it: OpenAI's `response_format` and vLLM's
`structured_outputs` and `guided_*` fields, turned into the one `structured_output` sampling
argument the nodes take (wire/structured_output.py lists its forms).

  API field                                            structured_output
  response_format {"type": "text"}                     none
  response_format {"type": "json_object"}              {"json_object": true}
  response_format {"type": "json_schema",
                   "json_schema": {"name", "schema"}}  {"json_schema": schema}
                   (no "schema": any JSON object)      {"json_object": true}
  structured_outputs {"json": schema or JSON text}     {"json_schema": schema}
  structured_outputs {"json_object": true}             {"json_object": true}
  structured_outputs {"regex" | "choice" | "grammar"}  the same key, the same value
  guided_json (schema or JSON text)                    {"json_schema": schema}
  guided_regex / guided_choice / guided_grammar        {"regex" | "choice" | "grammar": value}

A request asks for at most one of them (400 naming the second, in the order above); tool
calls forced by `tool_choice` (router/api/tools.py) are one more. The shape and sizes are checked
by `check_structured_output`, its errors renamed to the API field (`response_format.json_schema
.schema`); whether a schema, regex or grammar compiles is found out by the node (a 400 too).
vLLM's options that only tune its own backends (`disable_fallback`, `disable_any_whitespace`)
are accepted and unused: JSON is always generated on one line with one backend.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.api.tools import ToolPlan, forced_spec
from pdserve.router.errors import invalid
from pdserve.wire.structured_output import check_structured_output

Request = CompletionRequest | ChatCompletionRequest
Spec = dict[str, Any]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_GUIDED = (
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)
_VLLM_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
              "choice": "choice", "grammar": "grammar"}
_VLLM_NEUTRAL_OPTIONS = frozenset({"disable_fallback", "disable_any_whitespace"})


def structured_output_of(req: Request) -> tuple[Spec, str] | None:
    """The request's structured output spec and the field it came from, or None; 400 naming
    the field for a bad shape, or the second field when two ask for one."""
    found: list[tuple[Spec, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(spec)
    if req.structured_outputs is not None:
        found.append(_vllm_structured_outputs(req.structured_outputs))
    for field, kind in _GUIDED:
        value = getattr(req, field)
        if value is not None:
            if kind == "json_schema":
                value = _schema_value(value, field)
            found.append((_checked({kind: value}, field), field))
    if len(found) > 1:
        raise_second(found[0][1], found[1][1])
    return found[0] if found else None


def raise_second(first: str, second: str) -> None:
    raise invalid(
        f"'{second}' asks for structured output, and so does '{first}'; a request may use one.",
        second,
    )


def _response_format(value: dict[str, Any]) -> tuple[Spec, str] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    if kind != "json_schema":
        raise invalid(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
            "response_format.type",
        )
    body = value.get("json_schema")
    field = "response_format.json_schema"
    if not isinstance(body, dict):
        raise invalid(f"'{field}' must be an object with 'name' and 'schema'.", field)
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            f"'{field}.name' must be 1 to 64 letters, digits, underscores or dashes.",
            f"{field}.name",
        )
    if body.get("strict") not in (None, True, False):
        raise invalid(f"'{field}.strict' must be a boolean.", f"{field}.strict")
    schema = body.get("schema")
    if schema is None:
        return {"json_object": True}, "response_format"
    return _checked({"json_schema": schema}, f"{field}.schema"), "response_format"


def _vllm_structured_outputs(value: dict[str, Any]) -> tuple[Spec, str]:
    kinds = [key for key in value if key in _VLLM_KEYS and value[key] not in (None, False)]
    others = [
        key for key in value
        if key not in _VLLM_KEYS and key not in _VLLM_NEUTRAL_OPTIONS and value[key] is not None
    ]
    if others:
        field = f"structured_outputs.{others[0][:40]}"
        raise invalid(
            f"'{field}' is not supported by this server; structured_outputs takes one of "
            f"{', '.join(_VLLM_KEYS)}.",
            field,
        )
    if len(kinds) != 1:
        raise invalid(
            f"'structured_outputs' must hold exactly one of {', '.join(_VLLM_KEYS)}.",
            "structured_outputs",
        )
    key = kinds[0]
    field = f"structured_outputs.{key}"
    body = value[key]
    if key == "json":
        body = _schema_value(body, field)
    return _checked({_VLLM_KEYS[key]: body}, field), "structured_outputs"


def _schema_value(value: Any, field: str) -> Any:
    """vLLM takes a JSON schema as an object or as JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise invalid(f"'{field}' is not a JSON object nor JSON text.", field) from None


def _checked(spec: Spec, field: str) -> Spec:
    """`spec` through check_structured_output; its errors name `field` instead."""
    (kind,) = spec
    try:
        return check_structured_output(spec)
    except ValueError as error:
        message = str(error).replace(f"structured_output.{kind}", field, 1)
        raise invalid(f"{message}.", field) from None


def output_spec(req: Request, tools: ToolPlan | None = None) -> Spec | None:
    """The one structured_output spec a request's choices are sent with: the forced tool
    call(s) of `tools` (router/api/tools.py) or the request's own structured output fields."""
    asked = structured_output_of(req)
    forced = forced_spec(tools) if tools is not None else None
    if forced is None:
        return asked[0] if asked else None
    if asked is not None:
        raise_second("tool_choice", asked[1])
    return forced
