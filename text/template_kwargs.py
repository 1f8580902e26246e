"""The bounds on extra chat template variables (`chat_template_kwargs`, a request's or the
server's `--default-chat-template-kwargs`), one check for both:

  at most MAX_KWARGS_BYTES as JSON and MAX_KWARGS_DEPTH deep; names that are identifiers; none
  that replaces what the server renders itself (`messages`, `tools`, `documents`,
  `add_generation_prompt`, `continue_final_message`, the model's special tokens).

A `TemplateKwargsError` (a ValueError) names where: `param` is `FIELD.NAME` for a name that may
not be given, else FIELD.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

MAX_KWARGS_BYTES = 16 * 1024
MAX_KWARGS_DEPTH = 8
RENDERED_BY_SERVER = frozenset({
    "messages", "tools", "add_generation_prompt", "continue_final_message", "documents",
})


class TemplateKwargsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether `value` nests objects or arrays more than `levels` deep (looks no deeper)."""
    children = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, Mapping | list):
        return False
    return levels <= 0 or any(_deeper_than(child, levels - 1) for child in children)


def check_template_kwargs(
    kwargs: Any, special_tokens: Collection[str] = (), field: str = "chat_template_kwargs"
) -> dict[str, Any]:
    """`kwargs` as a dict, within the bounds (module docstring)."""
    if not isinstance(kwargs, Mapping):
        raise TemplateKwargsError(f"'{field}' must be a JSON object.", field)
    if any(_deeper_than(value, MAX_KWARGS_DEPTH - 1) for value in kwargs.values()):
        raise TemplateKwargsError(
            f"'{field}' must be at most {MAX_KWARGS_DEPTH} levels deep.", field
        )
    if len(json.dumps(kwargs)) > MAX_KWARGS_BYTES:
        raise TemplateKwargsError(
            f"'{field}' must be at most {MAX_KWARGS_BYTES:,} bytes as JSON.", field
        )
    for name in kwargs:
        param = f"{field}.{name}"
        if not (isinstance(name, str) and name.isidentifier()):
            raise TemplateKwargsError(f"'{param}' is not a template variable name.", field)
        if name in RENDERED_BY_SERVER or name in special_tokens:
            raise TemplateKwargsError(
                f"'{param}' is set by the server itself and cannot be given in '{field}'.",
                param,
            )
    return dict(kwargs)
