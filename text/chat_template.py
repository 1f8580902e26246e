"""A model's chat template rendered the way Hugging Face models expect, without transformers.

Templates come from the model's files and are untrusted code, so they run in Jinja's immutable
sandbox. The environment matches what chat templates are written against: `trim_blocks` and
`lstrip_blocks`, loop controls (`break`, `continue`), a `tojson` that keeps non-ASCII text and
takes `indent`, `raise_exception(message)` and `strftime_now(format)`. The conversation is in
`messages` (with assistant `tool_calls` and `tool` messages as the caller gives them) and the
callable functions in `tools`, as transformers' `apply_chat_template` passes them.

`TemplateOptions` are what a chat request may add, as vLLM's requests say them:
`add_generation_prompt` (end with the assistant's turn header), `continue_final_message` (end
inside the last message, its text left open for the model to go on: the rendered text is cut
right after that message's text, as transformers does), and `kwargs`, more variables for the
template (Qwen3's `enable_thinking`). The caller checks them (router/api/template_options.py);
a kwarg never replaces `messages`, `tools`, `add_generation_prompt` or a special token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox (a syntax error raises ChatTemplateError)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not parse: {error}") from None


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def render_chat(
    template: jinja2.Template,
    messages: list[dict],
    special_tokens: dict[str, str],
    tools: list[dict] | None = None,
    options: TemplateOptions | None = None,
) -> str:
    """The conversation as text, by default followed by the assistant's turn header. `tools`
    are the functions the model may call, OpenAI's `{"type": "function", "function": {...}}`
    maps, in the template's `tools` variable as Hugging Face passes them (None: no tools)."""
    options = options or TemplateOptions()
    variables = {
        **options.kwargs, "messages": messages, "tools": tools,
        "add_generation_prompt": options.add_generation_prompt, **special_tokens,
    }
    try:
        text = template.render(**variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template failed: {error}") from None
    if options.continue_final_message:
        return _open_final_message(text, messages[-1].get("content"))
    return text


def _open_final_message(text: str, content: Any) -> str:
    """`text` cut right after the last message's own text: with its trailing spaces where the
    template kept them, else after its last non-space character."""
    final = content.strip() if isinstance(content, str) else ""
    if not final:
        raise ChatTemplateError("continue_final_message needs a last message with text")
    start = text.rfind(final)
    if start < 0:
        raise ChatTemplateError(
            "the chat template does not show the last message's text as given, so it cannot "
            "be continued"
        )
    kept = content.lstrip()
    if text.startswith(kept, start):
        return text[: start + len(kept)]
    return text[: start + len(final)]
