"""A request's state inside one engine.

Lifecycle: WAITING (queued; also after preemption, with no blocks and nothing computed) ->
RUNNING (holds blocks; `num_computed_tokens` starts at the prefix reused from the cache and
grows by prefill chunks, then one per decode) ->
FINISHED (blocks freed in the step that finished it). Preemption moves RUNNING back to WAITING.
"""

from __future__ import annotations

import enum
import time

import torch

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_token_ids: frozenset[int],
        device: torch.device,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.arrival_time = time.monotonic()
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_blocks_offered = 0
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
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
        if self.num_output_tokens >= params.min_tokens and token_id in self.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens:
            return "length"
        return None
