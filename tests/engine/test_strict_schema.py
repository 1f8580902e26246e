"""Object schemas that leave extra properties unsaid are closed to them before they compile
(engine/sample/strict_schema.py): the walk follows JSON Schema's keywords, and constrained
output never invents a key unless the schema allows it."""

from __future__ import annotations

import json
import re

from pdserve.engine import SamplingParams
from pdserve.engine.sample.strict_schema import strict_schema

OPEN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}


def test_objects_that_say_nothing_are_closed_and_those_that_say_are_kept():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"type": {"type": "string"}}},
            "tags": {"type": "array", "items": {"properties": {"a": {"type": "integer"}}}},
            "open": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
            "pattern": {"type": "object", "patternProperties": {"^x": {}}},
            "maybe": {"anyOf": [{"type": ["object", "null"]}, {"type": "string"}]},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    strict = strict_schema(schema)
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    # a property named like a keyword is a property, not a keyword
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]
    assert set(props["properties"]["properties"]) == {"type"}
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["pattern"]
    assert props["maybe"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["maybe"]["anyOf"][1]
    assert strict["$defs"]["point"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


PROMPTS = [[5, 17, 99, 140], [200, 31, 64], [77, 8, 250, 12, 40]]


def invented_keys(llm, schema) -> int:
    """How many of the outputs of 8 seeds for each prompt began a key other than `city` (an
    output cut by max_tokens counts where its first key, finished or not, is not city's)."""
    invented = 0
    for seed in range(8):
        sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                                  structured_output={"json_schema": schema})
        for output in llm.generate(PROMPTS, sampling):
            if output.finish_reason == "stop":
                invented += bool(set(json.loads(output.text)) - {"city"})
                continue
            key = re.match(r'\{\s*"([^"]*)("?)', output.text)
            if key:
                closed = key[2] == '"'
                invented += key[1] != "city" if closed else not "city".startswith(key[1])
    return invented


def test_constrained_output_invents_no_key_unless_the_schema_allows_it(clean_tiny_llm):
    assert invented_keys(clean_tiny_llm, OPEN) == 0
    allowed = {**OPEN, "additionalProperties": True}
    assert invented_keys(clean_tiny_llm, allowed) > 0  # random weights do invent keys
