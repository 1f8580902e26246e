"""The prompts of a completions request. `prompt` takes OpenAI's four forms: a string, a list
of token ids, a list of strings, or a list of token-id lists. The last two are a batch: each
prompt gets `n` choices, and choice `i` of prompt `p` is answered as index `p * n + i`, as
OpenAI does (router/api/validation.py builds them into one `Plan`).

`split_prompts` tells the forms apart and names each prompt for the errors about it: `prompt`
when there is one, `prompt[i]` in a batch. A list that mixes forms, or holds anything but
strings, integers or lists of integers, is a 400 naming the first element that breaks the
form of the first (`prompt[i]`); an empty prompt is a 400 naming it. How many prompts a request may hold is
bounded by `RouterConfig.max_choices` (prompts x n), each prompt's length as a single one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.router.errors import invalid

_FORMS = "a string, a list of token ids, a list of strings, or a list of token-id lists"


@dataclass(frozen=True)
class PromptInput:
    """One prompt of the request: `text` or `token_ids` (exactly one is set)."""

    param: str
    text: str | None = None
    token_ids: list[int] | None = None


def _is_token_id(value: Any) -> bool:
    return type(value) is int  # not bool, not float


def _token_ids(values: list[Any], param: str) -> list[int]:
    if not all(map(_is_token_id, values)):
        raise invalid(f"'{param}' must be a list of token ids (integers).", param)
    return values


def split_prompts(prompt: str | list[Any]) -> list[PromptInput]:
    """The request's prompts in order; 400 naming the one that is empty or of no valid form."""
    if isinstance(prompt, str):
        return [PromptInput("prompt", text=prompt)]
    if not prompt:
        raise invalid("'prompt' must not be empty.", "prompt")
    first = prompt[0]
    if _is_token_id(first):
        for index, item in enumerate(prompt):
            if not _is_token_id(item):
                raise invalid(
                    f"'prompt' is a list of token ids, so 'prompt[{index}]' must be an integer.",
                    f"prompt[{index}]",
                )
        return [PromptInput("prompt", token_ids=prompt)]
    if isinstance(first, str):
        out = []
        for index, item in enumerate(prompt):
            if not isinstance(item, str):
                raise invalid(
                    f"'prompt[{index}]' must be a string like the other prompts of the list.",
                    f"prompt[{index}]",
                )
            out.append(PromptInput(f"prompt[{index}]", text=item))
        return out
    if isinstance(first, list):
        out = []
        for index, item in enumerate(prompt):
            param = f"prompt[{index}]"
            if not isinstance(item, list):
                raise invalid(
                    f"'{param}' must be a list of token ids like the other prompts of the list.",
                    param,
                )
            out.append(PromptInput(param, token_ids=_token_ids(item, param)))
        return out
    raise invalid(f"'prompt' must be {_FORMS}.", "prompt[0]")


def check_num_choices(num_prompts: int, n: int, max_choices: int) -> None:
    """400 when prompts x n exceeds what one request may ask for."""
    if num_prompts * n > max_choices:
        raise invalid(
            f"A request may ask for at most {max_choices} completions (prompts x n); this one "
            f"has {num_prompts} prompts x n={n}.",
            "prompt" if num_prompts > 1 else "n",
        )
