"""Hermes-style tool calls parsed out of a model's text: calls between `<tool_call>` tags,
text outside them kept as content, malformed or unclosed calls kept as text, and the same
pieces whether the text comes whole or one character at a time."""

from __future__ import annotations

import json

import pytest

from pdserve.router.api.tool_parser import HermesParser, ParsedCall, parse_call, parse_text

NAMES = {"get_weather", "add"}
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')


def streamed(text: str, step: int = 1) -> list:
    parser = HermesParser(NAMES)
    pieces = []
    for start in range(0, len(text), step):
        pieces += parser.feed(text[start : start + step])
    return merged(pieces + parser.finish())


def merged(pieces: list) -> list:
    """Adjacent text pieces joined (streaming splits text where it pleases)."""
    out: list = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out


CASES = [
    ("plain answer, no calls\n", ["plain answer, no calls\n"]),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [PARIS],
    ),
    (
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'),
        ["Let me check.", PARIS, ParsedCall("add", '{"a": 1, "b": 2}')],
    ),
    (
        ('Before <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> '
        "and after."),
        ["Before", PARIS, " and after."],
    ),
    # malformed calls stay text, tags included
    (
        'x <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        ['x <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'],
    ),
    (
        '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
        ['<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>'],
    ),
    (
        '<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>',
        ['<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>'],
    ),
    # an unclosed call (cut by max_tokens) and a partial tag at the end stay text
    (
        'Sure <tool_call>{"name": "get_weather", "arguments": {"ci',
        ['Sure <tool_call>{"name": "get_weather", "arguments": {"ci'],
    ),
    ("a <tool_c", ["a <tool_c"]),
    ("a < b and <tool is not a tag", ["a < b and <tool is not a tag"]),
]


@pytest.mark.parametrize(("text", "pieces"), CASES)
def test_whole_text_parses_into_content_and_calls(text, pieces):
    assert merged(parse_text(text, NAMES)) == pieces


@pytest.mark.parametrize(("text", "pieces"), CASES)
@pytest.mark.parametrize("step", [1, 2, 7])
def test_streamed_text_gives_the_same_pieces(text, pieces, step):
    assert streamed(text, step) == pieces


def test_text_that_may_begin_a_tag_is_held_back_and_nothing_else():
    parser = HermesParser(NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]  # the space waits too: a call may follow
    assert parser.feed("box>") == [" <toolbox>"]
    assert parser.feed(" <tool_call>{") == []
    assert parser.feed('"name": "add", "arguments": {}}</tool_call>') == [ParsedCall("add", "{}")]


def test_arguments_come_back_as_json_text_of_an_object():
    call = parse_call('{"name": "add", "arguments": {"a": 1, "é": [true, null]}}', NAMES)
    assert call is not None and json.loads(call.arguments) == {"a": 1, "é": [True, None]}
    assert parse_call("[1, 2]", NAMES) is None
    assert parse_call('{"name": 5, "arguments": {}}', NAMES) is None
