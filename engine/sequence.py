"""A request's state inside one engine.

Lifecycle: WAITING (queued; also after preemption by recompute, with no blocks and nothing
computed) -> RUNNING (holds blocks; `num_computed_tokens` starts at the prefix reused from the
cache and grows by prefill chunks, then one per decode) -> FINISHED (blocks freed in the step
that finished it). Preemption moves RUNNING back to WAITING (KV dropped, recomputed later) or
to SWAPPED (KV copied to the host blocks in `host_block_table`, `num_computed_tokens` kept;
waiting in the same queue, and copied back in when admitted again).

`priority`: lower is more important (as in vLLM's API); `arrival_time` orders equals.
"""

from __future__ import annotations

import enum
import time

import torch

from engine.sampling_params import SamplingParams


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
    ) -> None:
        self.request_id = request_id
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
