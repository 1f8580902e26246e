"""Tool calls, the answer side: a chat choice's text turned into OpenAI's `tool_calls`, in one
message or as stream deltas, by one reader per choice chosen by `tool_choice`
(router/api/tools.py says what each asks of the model):

  HermesCalls (auto)     Hermes-style tags parsed as the text streams (router/api/tool_parser.py);
                         the text outside them is content.
  ForcedNamed            the whole output is the named function's arguments: the call's id,
                         type and name go first, then the arguments as they are generated.
  ForcedRequired         the whole output is JSON, a list of calls (or one call): parsed when
                         the choice ends; output that does not parse (cut by max_tokens or a
                         stop string) is content.

A call gets an id `call_<24 hex digits>` and its `arguments` as JSON text. A choice that ends
("stop") having made a call ends with `finish_reason: "tool_calls"` and, in one message,
`content: null` unless the model also wrote text. Streamed, each call is one
`delta.tool_calls` entry `{index, id, type, function: {name, arguments}}` (ForcedNamed: then
`{index, function: {arguments}}` fragments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.api.tool_parser import HermesParser, ParsedCall
from pdserve.router.api.tools import ToolMode, ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Output:
    """What one event of a choice adds: content text, call entries (as streamed), and the
    finish reason to report."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceReader:
    """Reads one choice's text, event by event; `made_calls` once any call was made."""

    made_calls = False

    def feed(self, text: str, finish_reason: str | None) -> Output:
        raise NotImplementedError

    def _finish(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self.made_calls:
            return "tool_calls"
        return finish_reason


def _entry(index: int, call: ParsedCall) -> dict[str, Any]:
    return {
        "index": index,
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class HermesCalls(ChoiceReader):
    def __init__(self, plan: ToolPlan) -> None:
        self.parser = HermesParser(plan.names)
        self.num_calls = 0

    def feed(self, text: str, finish_reason: str | None) -> Output:
        pieces = self.parser.feed(text)
        if finish_reason is not None:
            pieces += self.parser.finish()
        out = Output()
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                out.calls.append(_entry(self.num_calls, piece))
                self.num_calls += 1
                self.made_calls = True
            else:
                out.content += piece
        out.finish_reason = self._finish(finish_reason)
        return out


class ForcedNamed(ChoiceReader):
    def __init__(self, plan: ToolPlan) -> None:
        self.name = plan.named

    def feed(self, text: str, finish_reason: str | None) -> Output:
        out = Output()
        if not self.made_calls:
            self.made_calls = True
            function = {"name": self.name, "arguments": text}
            out.calls.append({"index": 0, "id": new_call_id(), "type": "function",
                              "function": function})
        elif text:
            out.calls.append({"index": 0, "function": {"arguments": text}})
        out.finish_reason = self._finish(finish_reason)
        return out


class ForcedRequired(ChoiceReader):
    def __init__(self, plan: ToolPlan) -> None:
        self.names = plan.names
        self.text = ""

    def feed(self, text: str, finish_reason: str | None) -> Output:
        self.text += text
        if finish_reason is None:
            return Output()
        calls = self._calls()
        if calls is None:
            return Output(self.text, [], finish_reason)
        self.made_calls = True
        entries = [_entry(index, call) for index, call in enumerate(calls)]
        return Output("", entries, self._finish(finish_reason))

    def _calls(self) -> list[ParsedCall] | None:
        try:
            value = json.loads(self.text)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return None
            name, arguments = item.get("name"), item.get("arguments")
            if name not in self.names or not isinstance(arguments, dict):
                return None
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls or None


_READERS: dict[ToolMode, type[ChoiceReader]] = {
    ToolMode.AUTO: HermesCalls,
    ToolMode.NAMED: ForcedNamed,
    ToolMode.REQUIRED: ForcedRequired,
}


def reader_for(plan: ToolPlan) -> ChoiceReader:
    return _READERS[plan.mode](plan)


class ToolCallOutput:
    """The readers of a request's choices, and the answers they give."""

    def __init__(self, plan: ToolPlan, n: int) -> None:
        self.plan = plan
        self.readers = [reader_for(plan) for _ in range(n)]

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """A streamed event's delta and finish reason; None for the delta when it adds
        nothing and the choice goes on (no chunk to send)."""
        out = self.readers[index].feed(text, finish_reason)
        delta: dict[str, Any] = {}
        if out.content:
            delta["content"] = out.content
        if out.calls:
            delta["tool_calls"] = out.calls
        if not delta and out.finish_reason is None:
            return None, None
        return delta, out.finish_reason

    def message(self, choice: dict[str, Any]) -> None:
        """Rewrites a whole chat choice (schemas.chat_choice) from its text."""
        message = choice["message"]
        out = reader_for(self.plan).feed(message["content"], choice["finish_reason"])
        if not out.calls:
            return
        message["content"] = out.content or None
        message["tool_calls"] = [
            {key: value for key, value in call.items() if key != "index"} for call in out.calls
        ]
        choice["finish_reason"] = out.finish_reason
