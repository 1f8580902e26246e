"""OpenAI-shaped request models and response builders (completions and chat completions).

Requests are pydantic models in strict mode (no "5" -> 5 coercion), so a wrong type is a
validation error that `errors.validation_error` turns into a 400. Range checks that need the
router's settings or the node's limits live in `validation.py`, which bounds every number.
Strings are bounded by the body size; `user` (accepted, unused) and the `stop` strings (in
validation.py: the router matches them against every token's text) also by a length of their
own. The models hold the implemented fields only and ignore the others: router/api/unsupported.py
refuses the known ones pdserve does not implement and warns about unknown ones. A completions
`prompt` is one of OpenAI's four forms, told apart in router/api/prompts.py. Responses are plain
dicts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.wire.limits import INT32_MAX

MAX_USER_CHARS = 256


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _CommonParams(_Request):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    # vLLM extras
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = Field(0, ge=-INT32_MAX - 1, le=INT32_MAX)  # lower is served first
    skip_special_tokens: bool = True
    # the next-token distribution (router/api/sampling.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    # the prompt's scores (router/api/echo.py); `echo` is refused on chat
    echo: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens named token_id:N
    # structured output, read by router/api/structured.py
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_CommonParams):
    prompt: str | list[Any]  # text, token ids, or a list of either (router/api/prompts.py)
    logprobs: int | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # "function" parses, to be refused by name (router/api/unsupported.py)
    role: Literal["system", "user", "assistant", "tool", "function", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (router/api/tools.py)
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # tool calls, read by router/api/tools.py
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # how the conversation is rendered (router/api/template_options.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with --reasoning-parser (router/api/responses.py)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: `prompt`, or `messages` (router/api/tokenization.py)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for chat
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


Usage = dict[str, Any]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_body(
    object_name: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: Usage,
) -> dict[str, Any]:
    """A whole (non-streamed) response: `text_completion` or `chat.completion`."""
    return {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chunk(
    request_id: str,
    obj: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: Usage | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """A streamed chunk; `with_usage_field` adds `"usage": null` (or the usage) as OpenAI does
    when `stream_options.include_usage` is set."""
    out: dict[str, Any] = {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if with_usage_field or use is not None:
        out["usage"] = use
    return out
