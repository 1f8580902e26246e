"""JSON schemas made strict before they are compiled: an object schema that does not say
whether it allows more properties than it names allows none, so constrained output never
invents a key (`{"city": "Tokyo", "weather": "..."}` for a schema naming only `city`).

JSON Schema's own default is to allow them, and so is llguidance's; vLLM's default grammar
backend (xgrammar) forbids them, and OpenAI's strict mode requires schemas to say so. A schema
that wants extra keys says `"additionalProperties": true` (or a schema for them, or
`patternProperties` / `unevaluatedProperties`), and is left as it is.

The walk follows JSON Schema's keywords, so a property that happens to be named `properties`
or `type` is never taken for a keyword. It copies: the caller's schema is not changed.
"""

from __future__ import annotations

from typing import Any

# keyword -> how its value holds subschemas
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_WHEN_GIVEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "object" in kinds or (kind is None and "properties" in schema)


def strict_schema(schema: Any) -> Any:
    """`schema` with every object schema that leaves extra properties unsaid closed to them."""
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema
    out = dict(schema)
    for keyword in _ONE:
        if keyword in out:
            value = out[keyword]
            out[keyword] = (
                [strict_schema(s) for s in value] if isinstance(value, list)
                else strict_schema(value)
            )
    for keyword in _LIST:
        if isinstance(out.get(keyword), list):
            out[keyword] = [strict_schema(s) for s in out[keyword]]
    for keyword in _MAP:
        if isinstance(out.get(keyword), dict):
            out[keyword] = {name: strict_schema(s) for name, s in out[keyword].items()}
    if _is_object_schema(out) and not any(k in out for k in _OPEN_WHEN_GIVEN):
        out["additionalProperties"] = False
    return out
