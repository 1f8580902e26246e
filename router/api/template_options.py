"""A chat request's own say in how its conversation is rendered (text/chat_template.py's
`TemplateOptions`), as vLLM's chat and /tokenize requests give it, checked once:

  add_generation_prompt   bool, default true: end with the assistant's turn header
  continue_final_message  bool, default false: end inside the last message, its text open for
                          the model to go on (with add_generation_prompt true: 400, as vLLM)
  chat_template_kwargs    object: more variables for the template (`{"enable_thinking":
                          false}` for Qwen3), at most MAX_KWARGS_BYTES as JSON and
                          MAX_KWARGS_DEPTH deep; names are identifiers, and none may replace
                          what the server renders itself (`messages`, `tools`, the two options
                          above, the model's special tokens)

Each refusal is a 400 naming the field (`chat_template_kwargs.messages`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdserve.router.errors import invalid
from pdserve.text.chat_template import TemplateOptions

MAX_KWARGS_BYTES = 16 * 1024
MAX_KWARGS_DEPTH = 8
RENDERED_BY_SERVER = frozenset({
    "messages", "tools", "add_generation_prompt", "continue_final_message", "documents",
})


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether `value` nests objects or arrays more than `levels` deep (looks no deeper)."""
    children = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, Mapping | list):
        return False
    return levels <= 0 or any(_deeper_than(child, levels - 1) for child in children)


def template_options(req: Any, special_tokens: Mapping[str, str]) -> TemplateOptions:
    """The options of a validated chat or /tokenize request (its `add_generation_prompt`,
    `continue_final_message` and `chat_template_kwargs` fields); 400 naming the field that is
    out of bounds."""
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: the "
            "conversation ends either inside its last message or after it; set "
            "'add_generation_prompt' to false.",
            "continue_final_message",
        )
    kwargs = req.chat_template_kwargs or {}
    if any(_deeper_than(value, MAX_KWARGS_DEPTH - 1) for value in kwargs.values()):
        raise invalid(
            f"'chat_template_kwargs' must be at most {MAX_KWARGS_DEPTH} levels deep.",
            "chat_template_kwargs",
        )
    if len(json.dumps(kwargs)) > MAX_KWARGS_BYTES:
        raise invalid(
            f"'chat_template_kwargs' must be at most {MAX_KWARGS_BYTES:,} bytes as JSON.",
            "chat_template_kwargs",
        )
    for name in kwargs:
        param = f"chat_template_kwargs.{name}"
        if not name.isidentifier():
            raise invalid(f"'{param}' is not a template variable name.", "chat_template_kwargs")
        if name in RENDERED_BY_SERVER or name in special_tokens:
            raise invalid(
                f"'{param}' is set by the server itself and cannot be given in "
                "'chat_template_kwargs'.",
                param,
            )
    return TemplateOptions(
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        kwargs=dict(kwargs),
    )
