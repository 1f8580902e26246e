"""What structured output a request asks for (`SamplingParams.structured_output`), checked once.

A spec is a map with exactly one of these keys; it stays a plain map, so it travels inside
the `sampling` map of a wire message as it is:

  {"json_schema": {...}}      the output is JSON valid against this schema (a JSON object);
  {"json_object": true}       the output is a JSON object, any object;
  {"regex": "..."}            the whole output matches this regular expression (Rust `regex`
                              syntax: no lookaround, no backreferences; `\\d` is any Unicode
                              digit, `[0-9]` the ASCII ones);
  {"choice": ["a", "b"]}      the output is exactly one of these strings;
  {"grammar": "..."}          the output is in the language of this Lark grammar (llguidance's
                              dialect: `start: ...`, string literals, /regex/ terminals).

JSON is generated in one line, items separated by ", " and keys by ": " (json.dumps' look),
with no other whitespace: free whitespace lets a small model pad with newlines forever.

Only the shape and the sizes are checked here (pure Python, no grammar library): whether a
schema, regex or grammar compiles is found out by the engine (engine/sample/structured_output.py),
which fails that request alone with `GrammarError`, a ValueError the nodes report as a 400.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.wire.limits import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_JSON_SCHEMA_DEPTH,
    MAX_REGEX_CHARS,
)

STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# msgpack packs integers in [-2**63, 2**64); anything wider cannot cross the wire.
_WIRE_INT_MIN, _WIRE_INT_MAX = -(2**63), 2**64 - 1


class GrammarError(ValueError):
    """A request's structured output spec did not compile (a bad schema, regex or grammar)."""


def check_structured_output(value: Any) -> dict[str, Any] | None:
    """`value` as a structured output spec (module docstring), or None for none; ValueError
    naming the field, the rule and the limit otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(
            "structured_output must be a map with exactly one of the keys "
            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}"
        )
    (kind, body), = value.items()
    if kind == "json_schema":
        _check_json_schema(body)
    elif kind == "json_object":
        if body is not True:
            raise ValueError("structured_output.json_object must be true")
    elif kind == "regex":
        _check_text("structured_output.regex", body, MAX_REGEX_CHARS)
    elif kind == "choice":
        _check_choices(body)
    elif kind == "grammar":
        _check_text("structured_output.grammar", body, MAX_GRAMMAR_CHARS)
    else:
        raise ValueError(
            f"structured_output has an unknown key {str(kind)[:40]!r}; expected one of "
            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}"
        )
    return value


def spec_key(spec: dict[str, Any]) -> str:
    """The spec as canonical JSON text: equal specs, equal keys (the grammar cache's key)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _check_text(name: str, value: Any, max_chars: int) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if len(value) > max_chars:
        raise ValueError(f"{name} must be at most {max_chars:,} characters, got {len(value):,}")


def _check_choices(value: Any) -> None:
    name = "structured_output.choice"
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"{name} must have at most {MAX_CHOICES:,} strings, got {len(value):,}")
    if not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"{name} must hold non-empty strings only")
    total = sum(len(c) for c in value)
    if total > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"{name}'s strings must have at most {MAX_GRAMMAR_CHARS:,} characters together, "
            f"got {total:,}"
        )


def _check_json_schema(schema: Any) -> None:
    """A JSON object of bounded depth and size whose every value crosses the wire: maps with
    string keys, lists, strings, booleans, null, finite floats and 64-bit integers."""
    name = "structured_output.json_schema"
    if not isinstance(schema, dict):
        raise ValueError(  # noqa: TRY004 (every bad parameter is a ValueError)
            f"{name} must be a JSON object, got {type(schema).__name__}"
        )
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_SCHEMA_DEPTH:
                raise ValueError(
                    f"{name} must nest at most {MAX_JSON_SCHEMA_DEPTH} objects and arrays"
                )
            if isinstance(node, dict):
                if not all(isinstance(k, str) for k in node):
                    raise ValueError(f"{name} must have string keys only")
                node = node.values()
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, int) and not isinstance(node, bool):
            if not _WIRE_INT_MIN <= node <= _WIRE_INT_MAX:
                raise ValueError(f"{name} holds an integer beyond 64 bits")
        elif node is not None and not isinstance(node, (str, bool, float)):
            raise ValueError(f"{name} holds a {type(node).__name__}, which JSON cannot hold")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except ValueError:
        raise ValueError(f"{name} holds NaN or an infinity, which JSON cannot hold") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"{name} must be at most {MAX_GRAMMAR_CHARS:,} characters as JSON, got {len(text):,}"
        )
