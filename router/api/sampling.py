"""A request's sampling settings, built once as the SamplingParams the nodes receive: the one
check of every sampling number a client sends is SamplingParams' construction
(wire/sampling_params.py), and its SamplingError becomes the 400 naming the request's field.

Two steps, so that nothing waits for tokenizing to be refused:
  request_sampling   before the prompt is tokenized: every setting from the request, checked
                     (max_tokens the one asked for, else the largest there is until the
                     prompt's length decides it)
  choice_samplings   per prompt, once its length and the vocabulary are known: the resolved
                     max_tokens (min_tokens checked against it), top_k past the vocabulary
                     disabled, logit_bias and stop_token_ids within the vocabulary, and one
                     copy per choice with seed + i when a seed is given
As in vLLM, a temperature below 1e-5 is greedy (0) and a top_k of 0 or past the vocabulary is
disabled (-1). Fields the request leaves out keep SamplingParams' defaults; stop strings stay
in the router (router/generation.py cuts the text at them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.errors import APIError, invalid
from pdserve.wire.limits import INT32_MAX
from pdserve.wire.sampling_params import SamplingError, SamplingParams

Request = CompletionRequest | ChatCompletionRequest

# Request fields passed on under their own name when the request sets them.
_SAME_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "stop_token_ids",
)


def request_sampling(
    req: Request,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_output: dict[str, Any] | None = None,
    params: dict[str, str] | None = None,
) -> SamplingParams:
    """The request's settings, checked; `params` names the request's field of a SamplingParams
    field where they differ (chat: `max_tokens` may be `max_completion_tokens`, `logprobs` is
    `top_logprobs`)."""
    settings: dict[str, Any] = {
        name: getattr(req, name) for name in _SAME_NAMES if getattr(req, name) is not None
    }
    settings["max_tokens"] = INT32_MAX if max_tokens is None else max_tokens
    settings["logprobs"] = logprobs
    settings["prompt_logprobs"] = prompt_logprobs
    settings["structured_output"] = structured_output
    try:
        return SamplingParams(**settings)
    except SamplingError as error:
        raise _refusal(error, params) from None


def choice_samplings(
    sampling: SamplingParams,
    max_tokens: int,
    vocab_size: int,
    n: int,
    params: dict[str, str] | None = None,
) -> list[SamplingParams]:
    """`sampling` for one prompt of the request: its `n` choices' settings."""
    for token_id in sampling.logit_bias or {}:
        if token_id >= vocab_size:
            raise invalid(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}).", "logit_bias"
            )
    if any(token_id >= vocab_size for token_id in sampling.stop_token_ids or ()):
        raise invalid(
            f"'stop_token_ids' entries must be token ids in [0, {vocab_size}).", "stop_token_ids"
        )
    top_k = -1 if sampling.top_k >= vocab_size else sampling.top_k
    seed = sampling.seed
    try:
        return [
            dataclasses.replace(
                sampling,
                max_tokens=max_tokens,
                top_k=top_k,
                seed=None if seed is None else seed + i,
            )
            for i in range(n)
        ]
    except SamplingError as error:
        raise _refusal(error, params) from None


def _refusal(error: SamplingError, params: dict[str, str] | None) -> APIError:
    """The 400 for a setting that failed its check: the rule, never the client's value."""
    if error.field == "structured_output":
        return invalid(f"The structured output: {error.rule}.")
    param = (params or {}).get(error.field, error.field)
    if error.subject == error.field:
        return invalid(f"'{param}' {error.rule}.", param)
    return invalid(f"'{param}': {error.subject} {error.rule}.", param)
