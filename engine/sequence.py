"""A request's state inside one engine.

Lifecycle: WAITING (queued; also after preemption by recompute, with no blocks and nothing
computed) -> RUNNING (holds blocks; `num_computed_tokens` starts at the prefix reused from the
cache and grows by prefill chunks, then one per decode) -> FINISHED (blocks freed in the step
that finished it). Preemption moves RUNNING back to WAITING (KV dropped, recomputed later) or
to SWAPPED (KV copied to the host blocks in `host_block_table`, `num_computed_tokens` kept;
waiting in the same queue, and copied back in when admitted again).

`priority`: lower is more important (as in vLLM's API); `arrival_time` orders equals.
`group`: the client request this sequence serves (a batch of prompts, each with its choices, is
one request); `share_tier` is its share of that request (engine/sched/request_share.py), None until
the scheduler takes it.
`token_ids` only grows (prompt, then each appended output token), whatever the state.
`grammar` (a request with `structured_output`, once its grammar compiled) follows the output
tokens: `append_token` advances it, so it survives preemption as the tokens do.
`children` (a prompt asked for n > 1 choices): the choices' own sequences, which the prompt's
last position is sampled for in its place; they fork from it then (engine/forks.py).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.sample.prompt_logprobs import PromptLogprobs
from pdserve.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.sample.structured_output import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_token_ids: frozenset[int],
        device: torch.device,
        priority: int = 0,
        arrival_time: float | None = None,
        group: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.group = request_id if group is None else group
        self.share_tier: int | None = None
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.priority = priority
        self.sequence_number = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.host_block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_blocks_offered = 0
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.prompt_logprobs = (
            PromptLogprobs(params.prompt_logprobs, len(prompt_token_ids))
            if params.prompt_logprobs is not None
            else None
        )
        self.grammar: SequenceGrammar | None = None
        self.children: list[Sequence] = []
        self._token_id_buffer = np.empty(0, dtype=np.int64)
        self._num_buffered_token_ids = 0
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def token_id_array(self) -> np.ndarray:
        """`token_ids` as an int64 array, for the sampler's batched penalties. Kept as the
        sequence grows: a call copies only the ids appended since the last one (whoever
        appended them), so a step costs O(new tokens) in Python, not O(history)."""
        num_tokens = len(self.token_ids)
        start = self._num_buffered_token_ids
        if num_tokens > len(self._token_id_buffer):
            grown = np.empty(max(num_tokens, 2 * len(self._token_id_buffer)), dtype=np.int64)
            grown[:start] = self._token_id_buffer[:start]
            self._token_id_buffer = grown
        self._token_id_buffer[start:num_tokens] = self.token_ids[start:]
        self._num_buffered_token_ids = num_tokens
        return self._token_id_buffer[:num_tokens]

    @property
    def num_seqs(self) -> int:
        """How many sequences this one stands for (its children, once forked)."""
        return len(self.children) or 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> str | None:
        """Adds a sampled token; returns the finish reason if it ends the sequence."""
        self.token_ids.append(token_id)
        params = self.params
        if self.grammar is not None:
            reason = self.grammar.advance(token_id)
            if reason is not None:
                return reason
        if self.num_output_tokens >= params.min_tokens and token_id in self.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens:
            return "length"
        return None
