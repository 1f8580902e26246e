"""`echo` and `prompt_logprobs`: what they ask of the nodes, and their checks.

`echo` (completions only) answers each prompt before its completion: the prompt as given (its
text, or its token ids decoded), and with `logprobs` the prompt's tokens first in `logprobs`,
the first one's `token_logprobs` and `top_logprobs` entries null (nothing comes before it), as
OpenAI's and vLLM's servers do. When streaming, a choice's first chunk carries them.

`max_tokens: 0` is allowed only with `echo` (the prompt alone, lm-eval's loglikelihood
request): the node is asked for one token, which the router drops: the text is the prompt,
`finish_reason` "length" and the choice's completion tokens 0 (vLLM counts the dropped token
in `usage`; OpenAI, and this server, do not).

`prompt_logprobs` (vLLM's; completions and chat) returns the prompt's scores in vLLM's shape
(router/api/logprobs.py): on each choice for completions, on the response for chat. Not while
streaming: vLLM refuses a positive value with `stream`; this server refuses any, so nothing
asked for is silently left out.

Either asks the nodes to score the prompt (`prompt_logprobs` in the sampling settings, with
the larger of the two alternative counts; engine/sample/prompt_logprobs.py), for prompts of
at most MAX_PROMPT_LOGPROBS_TOKENS tokens. A prompt scored takes no prefix-cache hit on the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.router.api.prompts import PromptInput
from pdserve.router.errors import invalid
from pdserve.wire.limits import MAX_PROMPT_LOGPROBS_TOKENS


@dataclass(frozen=True)
class PromptScoring:
    """What a request asks about its prompts: `echo` them, nothing but them (`prompt_only`,
    max_tokens 0), and `num_top` alternatives per prompt token from the nodes (None: no
    scores)."""

    echo: bool = False
    prompt_only: bool = False
    num_top: int | None = None


def check_prompt_scoring(req: Any, logprobs: int | None) -> PromptScoring:
    """The request's `echo`, `max_tokens: 0` and `prompt_logprobs`; 400 naming the parameter
    that breaks a rule. `logprobs` is the number of alternatives of the output's tokens."""
    echo = bool(getattr(req, "echo", False))
    prompt_only = echo and req.max_tokens == 0
    if req.max_tokens == 0 and not echo:
        raise invalid("'max_tokens' may be 0 only with 'echo': true.", "max_tokens")
    if prompt_only and req.min_tokens > 0:
        raise invalid("'min_tokens' must be 0 when 'max_tokens' is 0.", "min_tokens")
    if req.prompt_logprobs is not None and req.stream:  # its range: SamplingParams'
        raise invalid(
            "'prompt_logprobs' are not available when 'stream' is true.", "prompt_logprobs"
        )
    asked = [k for k in (req.prompt_logprobs, logprobs if echo else None) if k is not None]
    return PromptScoring(echo, prompt_only, max(asked) if asked else None)


def check_scored_prompt(ids: list[int], scoring: PromptScoring, param: str) -> None:
    """400 for a prompt too long to be scored."""
    if scoring.num_top is not None and len(ids) > MAX_PROMPT_LOGPROBS_TOKENS:
        raise invalid(
            f"Prompt logprobs ('prompt_logprobs', or 'echo' with 'logprobs') are computed for "
            f"prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS:,} tokens; '{param}' has "
            f"{len(ids):,}.",
            param,
        )


def echo_text(prompt: PromptInput, ids: list[int], tokenizer: Any) -> str:
    """The prompt as the client gave it: its text, or its token ids decoded."""
    if prompt.text is not None:
        return prompt.text
    return tokenizer.decode(ids, skip_special_tokens=False)
