from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sample.prompt_logprobs import PromptTokenLogprobs
from pdserve.engine.sample.sampler import TokenLogprobs


@dataclass
class StepOutput:
    """What one engine step produced for one request: its new tokens, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    offset: int = 0  # index of the first new token among the request's output tokens
    # with the first token of a request that asked: one per prompt token after the first
    prompt_logprobs: list[PromptTokenLogprobs] | None = None


@dataclass
class EngineStep:
    """What one `LLMEngine.step()` did: the tokens it sampled, the prompt blocks it filled
    for requests added with `export_prompt_blocks` (request id -> block ids, in prompt order,
    each held for the caller until it calls `release_blocks`), and for each prompt it advanced
    without finishing, the prompt tokens computed so far beyond its prefix-cache hit (request
    id -> tokens: a long prompt's progress between its chunks)."""

    outputs: list[StepOutput] = field(default_factory=list)
    exported_blocks: dict[str, list[int]] = field(default_factory=dict)
    prompt_progress: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """A finished (or, while streaming, partial) generation."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
