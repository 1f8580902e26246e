"""A chat request's own say in how its conversation is rendered (text/chat_template.py's
`TemplateOptions`), as vLLM's chat and /tokenize requests give it, checked once:

  add_generation_prompt   bool, default true: end with the assistant's turn header
  continue_final_message  bool, default false: end inside the last message, its text open for
                          the model to go on (with add_generation_prompt true: 400, as vLLM)
  chat_template_kwargs    object: more variables for the template (`{"enable_thinking":
                          false}` for Qwen3), over the server's `--default-chat-template-kwargs`;
                          bounded as text/template_kwargs.py says

Each refusal is a 400 naming the field (`chat_template_kwargs.messages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.router.errors import invalid
from pdserve.text.chat_template import TemplateOptions
from pdserve.text.template_kwargs import TemplateKwargsError, check_template_kwargs


def template_options(
    req: Any, special_tokens: Mapping[str, str], defaults: Mapping[str, Any] | None = None
) -> TemplateOptions:
    """The options of a validated chat or /tokenize request (its `add_generation_prompt`,
    `continue_final_message` and `chat_template_kwargs` fields) over the server's `defaults`;
    400 naming the field that is out of bounds."""
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: the "
            "conversation ends either inside its last message or after it; set "
            "'add_generation_prompt' to false.",
            "continue_final_message",
        )
    try:
        kwargs = check_template_kwargs(req.chat_template_kwargs or {}, special_tokens)
    except TemplateKwargsError as error:
        raise invalid(str(error), error.param) from None
    return TemplateOptions(
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        kwargs={**(defaults or {}), **kwargs},
    )
