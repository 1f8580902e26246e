"""Hermes-style tool calls in a model's text: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, the format of Qwen2.5, Qwen3 and the Hermes models, and the one pdserve asks
for where a template has no format of its own (router/api/tools.py).

`HermesParser` reads the text as it streams and hands back pieces in order: text (content)
and `ParsedCall`s. Text is held back only while it may still be the start of an opening tag,
and a call only until its closing tag. A call that is malformed (no JSON object, no string
`name`, a name not among the request's tools, `arguments` not an object) stays text, tags
included; so does an opening tag never closed. Whitespace just before or after a call (the
newlines between calls) is dropped; an answer without calls keeps all of its whitespace.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text


Piece = str | ParsedCall


def parse_call(body: str, names: Collection[str]) -> ParsedCall | None:
    """The call `body` (the JSON between the tags) makes, or None when it is malformed."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _partial_tag_length(text: str) -> int:
    """How many characters at the end of `text` could begin an opening tag."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


class HermesParser:
    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self.buffer = ""
        self.space = ""  # whitespace held until we know whether a call follows it
        self.num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while True:
            start = self.buffer.find(OPEN_TAG)
            if start < 0:
                keep = _partial_tag_length(self.buffer)
                self._text(self.buffer[: len(self.buffer) - keep], pieces)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return pieces
            self._text(self.buffer[:start], pieces)
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE_TAG, len(OPEN_TAG))
            if end < 0:
                return pieces
            raw = self.buffer[: end + len(CLOSE_TAG)]
            self.buffer = self.buffer[end + len(CLOSE_TAG) :]
            call = parse_call(raw[len(OPEN_TAG) : end], self.names)
            if call is None:
                self._text(raw, pieces)
            else:
                self.space = ""
                self.num_calls += 1
                pieces.append(call)

    def finish(self) -> list[Piece]:
        """The text still held (an unclosed tag stays text)."""
        pieces: list[Piece] = []
        self._text(self.buffer, pieces)
        self.buffer = ""
        if self.space and not self.num_calls:
            pieces.append(self.space)
        self.space = ""
        return pieces

    def _text(self, text: str, pieces: list[Piece]) -> None:
        """Text, less its trailing whitespace, which waits for what comes next."""
        stripped = text.rstrip()
        if stripped:
            pieces.append(self.space + stripped)
            self.space = ""
        self.space += text[len(stripped) :]


def parse_text(text: str, names: Collection[str]) -> list[Piece]:
    """Every piece of a whole text."""
    parser = HermesParser(names)
    return parser.feed(text) + parser.finish()
