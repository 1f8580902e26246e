"""Turns a parsed request into what the router submits: prompt ids, per-choice sampling
settings for the node, stop strings. Every check here raises a 400 `APIError` naming the
parameter; messages state the rule and the limit, not the client's input (context-length
errors state the token counts, as OpenAI's do).

Every number a client sends is bounded before any arithmetic on it (the schema bounds
`priority`): the sampling settings by building them (router/api/sampling.py: SamplingParams'
construction is their one check), `n`, the stop strings and the prompts here, token ids
against the vocabulary, the completion against the context. Text must be valid Unicode and
whatever the tokenizer refuses is the client's 400.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.api.echo import (
    PromptScoring,
    check_prompt_scoring,
    check_scored_prompt,
    echo_text,
)
from pdserve.router.api.prompts import PromptInput, check_num_choices, split_prompts
from pdserve.router.api.sampling import choice_samplings, request_sampling
from pdserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.api.structured import output_spec
from pdserve.router.api.template_options import template_options
from pdserve.router.api.tools import ToolPlan, check_tools, template_input
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError, invalid
from pdserve.wire.roles import Role
from pdserve.wire.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP_STRING_CHARS = 1024

Limits = Callable[[], "tuple[int, int]"]
CheckChars = Callable[[int, Limits, str], None]  # (characters, limits, param): RouterState's


@dataclass
class Plan:
    """A validated request, ready to submit as `n` sub-requests (choices): `choices_per_prompt`
    for each prompt, in order, so choice `i` answers prompt `i // choices_per_prompt`.
    `scoring` says what it asks about its prompts (router/api/echo.py): `echo_prompts` are the
    texts echoed, one per prompt, and `prompt_logprobs` the alternatives the client asked for
    in its `prompt_logprobs` field. `tools`: the chat's tool calls (router/api/tools.py), which
    router/api/tool_output.py reads out of each choice's text."""

    prompts: list[list[int]]
    samplings: list[SamplingParams]
    stop: list[str]
    skip_special_tokens: bool = True
    logprobs: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    scoring: PromptScoring = field(default_factory=PromptScoring)
    echo_prompts: list[str] | None = None
    prompt_logprobs: int | None = None
    tools: ToolPlan | None = None

    @property
    def n(self) -> int:
        return len(self.samplings)

    @property
    def choices_per_prompt(self) -> int:
        return len(self.samplings) // len(self.prompts)

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.choices_per_prompt]


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    """404 unless `requested` is absent or one of the `served` names."""
    if requested is not None and requested not in served:
        raise APIError(
            404,
            f"The model '{_clip(requested)}' does not exist.",
            param="model",
            code="model_not_found",
        )


def _clip(text: str, limit: int = 64) -> str:
    """Model names are echoed (as OpenAI does) but kept short and printable."""
    clipped = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return clipped if len(text) <= limit else clipped + "..."


def check_common(req: CompletionRequest | ChatCompletionRequest, config: RouterConfig) -> list[str]:
    """Checks what both APIs share beyond the sampling settings; returns the stop strings."""
    if not 1 <= req.n <= config.max_n:
        raise invalid(f"'n' must be between 1 and {config.max_n}.", "n")
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(req, name, None)  # chat's `logprobs` is a switch, not a count
        if isinstance(value, int) and not isinstance(value, bool) and value > config.max_logprobs:
            raise invalid(
                f"'{name}' must be at most {config.max_logprobs} on this server "
                "(its --max-logprobs).",
                name,
            )
    if req.priority != 0 and not config.allow_client_priority:
        raise invalid(
            "'priority' is not allowed on this server: its operator lets clients set it with "
            "--allow-client-priority.",
            "priority",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > config.max_stop:
        raise invalid(f"'stop' accepts at most {config.max_stop} strings.", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise invalid(
            f"each 'stop' string must be at most {MAX_STOP_STRING_CHARS:,} characters.", "stop"
        )
    if req.stream_options is not None and not req.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    return [s for s in stop if s]


def prompt_ids(prompt: PromptInput, tokenizer: Any) -> list[int]:
    """The prompt's token ids; 400 naming it for text the tokenizer cannot encode."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    try:
        return list(tokenizer.encode(prompt.text))
    except Exception:  # noqa: BLE001 (whatever the tokenizer refuses is the client's text)
        raise invalid(
            f"'{prompt.param}' is text the model's tokenizer cannot encode.", prompt.param
        ) from None


def chat_prompt(
    req: ChatCompletionRequest,
    tokenizer: Any,
    tool_plan: ToolPlan | None = None,
    default_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The conversation's token ids; `default_kwargs`: the server's template variables."""
    messages, tools = template_input(req.messages, tool_plan, tokenizer)
    options = template_options(req, tokenizer.special_tokens, default_kwargs)
    try:
        return list(tokenizer.apply_chat_template(messages, tools=tools, options=options))
    except ValueError as error:
        raise invalid(str(error), "messages") from None
    except Exception:  # noqa: BLE001 (template errors are the request's fault)
        raise invalid("the messages do not fit the model's chat template.", "messages") from None


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise invalid(f"'{param}' must not be empty.", param)
    if any(not 0 <= i < vocab_size for i in ids):
        raise invalid(f"token ids in '{param}' must be in [0, {vocab_size}).", param)


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    prompt_len: int,
    max_model_len: int,
    params: tuple[str, str] = ("max_tokens", "messages"),
) -> int:
    """The max_tokens to use; 400 if prompt plus completion exceed the context, naming
    `params[0]` (the limit's field) when the client set a limit, else `params[1]` (the
    prompt's)."""
    max_tokens = requested if requested is not None else default
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if prompt_len + max(max_tokens, 1) > max_model_len:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the prompt, "
            f"{max(max_tokens, 0)} for the completion). Please reduce the length of the prompt "
            "or the completion.",
            params[0] if requested is not None else params[1],
        )
    return max_tokens


@dataclass(frozen=True)
class KVCapacity:
    """The largest KV caches, in blocks, of the live nodes that would serve a request: decode
    (or colocated) nodes hold prompt and completion, prefill nodes the prompt (None: no
    prefill node is involved). 0 blocks or block size: not known yet, nothing is checked."""

    block_size: int
    serving_blocks: int
    prefill_blocks: int | None = None


def check_kv_capacity(plan: Plan, capacity: KVCapacity) -> None:
    """400 for a request that fits the context length but no node's whole KV cache: it could
    never be scheduled, so it is refused at once instead of waiting for blocks forever."""
    if capacity.block_size < 1:
        return
    for choice, sampling in enumerate(plan.samplings):
        if choice % plan.choices_per_prompt == 0:
            _check_kv_need(len(plan.prompt_of(choice)), sampling.max_tokens, capacity)


def _check_kv_need(prompt: int, max_tokens: int, capacity: KVCapacity) -> None:
    block_size = capacity.block_size
    needs = [
        (Role.DECODE if capacity.prefill_blocks is not None else Role.COLOCATED, prompt + max_tokens,
         capacity.serving_blocks, "prompt and completion"),
    ]
    if capacity.prefill_blocks is not None:
        needs.append((Role.PREFILL, prompt + 1, capacity.prefill_blocks, "prompt"))
    for role, tokens, blocks, what in needs:
        needed = -(-tokens // block_size)
        if blocks and needed > blocks:
            raise invalid(
                f"This request needs {needed:,} KV blocks of {block_size} tokens for its {what} "
                f"({prompt:,} prompt tokens, {max_tokens:,} for the completion), but the "
                f"largest KV cache of a live {role} node holds {blocks:,} blocks "
                f"({blocks * block_size:,} tokens), so it can never be served. Please reduce "
                "the length of the prompt or the completion.",
                "max_tokens" if role != Role.PREFILL else None,
            )


def plan_completion(
    req: CompletionRequest,
    config: RouterConfig,
    tokenizer: Any,
    limits: Limits,
    check_chars: CheckChars | None = None,
) -> Plan:
    """Checks the parameters and the form and number of the prompts, then (only then) asks
    `limits()` for the node's context length and vocabulary size (it raises the 503 when no
    node is alive) and checks each prompt: its characters (`check_chars`, before tokenizing),
    its token ids and its length with the completion's."""
    scoring = check_prompt_scoring(req, req.logprobs)
    structured_output = output_spec(req)
    requested = 1 if scoring.prompt_only else req.max_tokens  # max_tokens 0: one, dropped
    stop = check_common(req, config)
    sampling = request_sampling(req, requested, req.logprobs, scoring.num_top, structured_output)
    prompts = split_prompts(req.prompt)
    check_num_choices(len(prompts), req.n, config.max_choices)
    for prompt in prompts:
        if prompt.text is not None and not prompt.text:
            raise invalid(f"'{prompt.param}' must not be empty.", prompt.param)
    max_model_len, vocab_size = limits()
    all_ids, all_samplings, echo_prompts = [], [], []
    for prompt in prompts:
        if prompt.text is not None and check_chars is not None:
            check_chars(len(prompt.text), limits, prompt.param)
        ids = prompt_ids(prompt, tokenizer)
        check_prompt_ids(ids, vocab_size, prompt.param)
        check_scored_prompt(ids, scoring, prompt.param)
        if scoring.echo:
            echo_prompts.append(echo_text(prompt, ids, tokenizer))
        max_tokens = resolve_max_tokens(
            requested,
            DEFAULT_COMPLETION_MAX_TOKENS,
            len(ids),
            max_model_len,
            ("max_tokens", prompt.param),
        )
        all_ids.append(ids)
        all_samplings += choice_samplings(sampling, max_tokens, vocab_size, req.n)
    return Plan(
        all_ids,
        all_samplings,
        stop,
        req.skip_special_tokens,
        req.logprobs,
        priority=req.priority,
        scoring=scoring,
        echo_prompts=echo_prompts if scoring.echo else None,
        prompt_logprobs=req.prompt_logprobs,
    )


def plan_chat(
    req: ChatCompletionRequest, config: RouterConfig, tokenizer: Any, limits: Limits
) -> Plan:
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = getattr(req, limit_param)
    stop = check_common(req, config)
    if limit_param == "max_completion_tokens" and req.max_tokens is not None:  # superseded
        request_sampling(req, req.max_tokens, None)  # but still a valid number
    if req.echo:
        raise invalid("'echo' is available on /v1/completions only.", "echo")
    scoring = check_prompt_scoring(req, None)
    tools = check_tools(req)
    structured_output = output_spec(req, tools)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = {"max_tokens": limit_param, "logprobs": "top_logprobs"}
    sampling = request_sampling(
        req, requested, logprobs, scoring.num_top, structured_output, params
    )
    max_model_len, vocab_size = limits()
    ids = chat_prompt(req, tokenizer, tools, config.default_chat_template_kwargs)
    check_prompt_ids(ids, vocab_size, "messages")
    check_scored_prompt(ids, scoring, "messages")
    max_tokens = resolve_max_tokens(
        requested, None, len(ids), max_model_len, (limit_param, "messages")
    )
    return Plan(
        [ids],
        choice_samplings(sampling, max_tokens, vocab_size, req.n, params),
        stop,
        req.skip_special_tokens,
        logprobs,
        priority=req.priority,
        scoring=scoring,
        prompt_logprobs=req.prompt_logprobs,
        tools=tools,
    )
