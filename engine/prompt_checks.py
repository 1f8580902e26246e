"""The checks a request's prompt and parameters pass before it is queued: token ids inside the
vocabulary, prompt logprobs on a prompt of bounded length, and a prompt plus max_tokens that
fit both the context and the whole KV cache. Each failure is a ValueError naming the value and
what was expected (the router turns it into a 400)."""

from __future__ import annotations

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.wire.limits import MAX_PROMPT_LOGPROBS_TOKENS
from pdserve.wire.sampling_params import SamplingParams


def check_prompt(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_manager: BlockManager,
) -> None:
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    if (
        params.prompt_logprobs is not None
        and len(prompt_token_ids) > MAX_PROMPT_LOGPROBS_TOKENS
    ):
        raise ValueError(
            f"prompt has {len(prompt_token_ids):,} tokens; prompt logprobs are computed "
            f"for prompts of at most {MAX_PROMPT_LOGPROBS_TOKENS:,} tokens"
        )
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids):,} tokens and max_tokens is "
            f"{params.max_tokens:,}; the model's maximum context length is "
            f"{max_model_len:,} tokens"
        )
    needed = block_manager.blocks_for_tokens(total)
    if needed > block_manager.num_blocks:
        raise ValueError(
            f"prompt has {len(prompt_token_ids):,} tokens and max_tokens is "
            f"{params.max_tokens:,}, needing {needed:,} KV blocks; the KV cache holds "
            f"only {block_manager.num_blocks:,}"
        )
