"""Request fields the router knows but does not implement, and fields it does not know.

Never silent: a known OpenAI or vLLM parameter that pdserve does not implement is a 400 naming
it, unless it holds its neutral value (the one that leaves the output as if it were absent:
`length_penalty: 1`, `functions: []`, null). `NOT_IMPLEMENTED` is the one table of them;
implementing a parameter means adding it to router/api/schemas.py and removing its entry here.
The chat history is held to the same rule: the legacy function messages, and assistant
messages that carry a `function_call`, are refused naming `messages[i].<field>` (tool messages
and `tool_calls` are implemented, router/api/tools.py).

Fields that only describe the request (`INFORMATIONAL`) are accepted. Any other field is
unknown: accepted, as vLLM does, with one warning per field name (`UnknownFieldLog`, one per
app: at most `MAX_WARNED_NAMES` names, each cut to `MAX_LOGGED_NAME_CHARS`, so a client
sending random names grows neither memory nor the log without bound).

Order in a route: pydantic parses the body (types of the implemented fields, router/api/schemas.py,
which ignores extra fields), then `check_not_implemented(body)`, then `unknown_fields`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel

from pdserve.router.errors import invalid

logger = logging.getLogger(__name__)

MAX_WARNED_NAMES = 64
MAX_LOGGED_NAME_CHARS = 40

Body = dict[str, Any]
Neutral = Callable[[Any, Body], bool]


def _null(value: Any, _: Body) -> bool:
    return value is None


def _is(*neutrals: Any) -> Neutral:
    """Null, or equal to one of `neutrals` with the same JSON type (so `false` is not `0`)."""

    def neutral(value: Any, _: Body) -> bool:
        return value is None or any(
            type(value) is type(n) and value == n for n in neutrals
        )

    return neutral


def _number(neutral_value: float) -> Neutral:
    def neutral(value: Any, _: Body) -> bool:
        if value is None:
            return True
        return type(value) in (int, float) and value == neutral_value

    return neutral


def _no_choice(options_field: str) -> Neutral:
    """`function_call`: "none", or "auto" with no functions to choose from."""

    def neutral(value: Any, body: Body) -> bool:
        return value is None or value == "none" or (value == "auto" and not body.get(options_field))

    return neutral


def _best_of(value: Any, body: Body) -> bool:
    return value is None or (type(value) is int and value == body.get("n", 1))


@dataclass(frozen=True)
class NotImplementedParam:
    accepted: str  # the neutral values, as the error message states them
    neutral: Neutral


_NULL = NotImplementedParam("null", _null)
_EMPTY_LIST = NotImplementedParam("an empty list or null", _is([]))
_NO_CHOICE = "\"none\", \"auto\" without {}, or null"

# name -> the values that leave the output unchanged. Remove an entry when it is implemented.
NOT_IMPLEMENTED: MappingProxyType[str, NotImplementedParam] = MappingProxyType({
    # OpenAI
    "functions": _EMPTY_LIST,
    "function_call": NotImplementedParam(
        _NO_CHOICE.format("'functions'"), _no_choice("functions")
    ),
    "best_of": NotImplementedParam("null or the value of 'n'", _best_of),
    "suffix": NotImplementedParam('"" or null', _is("")),
    "modalities": NotImplementedParam('["text"] or null', _is(["text"])),
    "audio": _NULL,
    # vLLM
    "length_penalty": NotImplementedParam("1 or null", _number(1)),
    "use_beam_search": NotImplementedParam("false or null", _is(False)),
    "bad_words": _EMPTY_LIST,
    "allowed_token_ids": _NULL,
    "include_stop_str_in_output": NotImplementedParam("false or null", _is(False)),
    "spaces_between_special_tokens": NotImplementedParam("true or null", _is(True)),
    "truncate_prompt_tokens": _NULL,
    "chat_template": _NULL,
    "documents": _NULL,
})

# Accepted and unused: they describe the request, never change its output.
INFORMATIONAL = frozenset({
    "metadata", "request_id", "service_tier", "store",
})

_REFUSED_ROLES = ("function",)
_MESSAGE_CALL_FIELDS = ("function_call",)


def check_not_implemented(body: Body) -> None:
    """400 naming the first field of `body` (then of its messages) that asks for something
    pdserve does not implement. `body` has passed its pydantic model already."""
    for name, value in body.items():
        param = NOT_IMPLEMENTED.get(name)
        if param is not None and not param.neutral(value, body):
            raise invalid(
                f"'{name}' is not supported by this server; it accepts only {param.accepted}.",
                name,
            )
    messages = body.get("messages")
    if isinstance(messages, list):
        for index, message in enumerate(messages):
            if isinstance(message, dict):
                _check_message(index, message)


def _check_message(index: int, message: Body) -> None:
    role = message.get("role")
    if role in _REFUSED_ROLES:
        raise invalid(
            f"messages with role '{role}' are not supported: this server implements tool "
            "calls ('tools', role 'tool'), not the legacy function calls.",
            f"messages[{index}].role",
        )
    for name in _MESSAGE_CALL_FIELDS:
        if message.get(name) not in (None, []):
            raise invalid(
                f"'{name}' in a message is not supported: this server implements tool calls "
                "('tool_calls'), not the legacy function calls.",
                f"messages[{index}].{name}",
            )


def known_fields(model: type[BaseModel]) -> frozenset[str]:
    """The top-level fields a route knows: implemented, not implemented, informational."""
    return frozenset(model.model_fields).union(NOT_IMPLEMENTED, INFORMATIONAL)


def unknown_fields(body: Body, known: frozenset[str]) -> list[str]:
    return [name for name in body if name not in known]


class UnknownFieldLog:
    """Warns once per unknown field name, for at most `max_names` names per app (then once
    that it stops); names are logged cut to `MAX_LOGGED_NAME_CHARS` printable characters."""

    def __init__(self, max_names: int = MAX_WARNED_NAMES) -> None:
        self.max_names = max_names
        self.warned: set[str] = set()
        self.full = False

    def note(self, route: str, names: Iterable[str]) -> None:
        for name in names:
            shown = _printable(name)
            if shown in self.warned:
                continue
            if len(self.warned) >= self.max_names:
                if not self.full:
                    self.full = True
                    logger.warning(
                        "%d unknown request field names were logged; further ones are ignored "
                        "without a warning",
                        self.max_names,
                    )
                return
            self.warned.add(shown)
            logger.warning(
                "%s: the unknown request field '%s' is ignored (logged once per name)",
                route,
                shown,
            )


def _printable(name: str) -> str:
    clipped = "".join(ch if ch.isprintable() else "?" for ch in name[:MAX_LOGGED_NAME_CHARS])
    return clipped if len(name) <= MAX_LOGGED_NAME_CHARS else clipped + "..."
