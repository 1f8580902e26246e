"""One node in the simulation: what the engine's scheduler would put in its next step, and
what that step finishes.

A node holds sequences in arrival order (the scheduler's rank when priorities are equal):
prompts still to compute and sequences decoding. A step takes them in that order while the
token budget (`max_num_batched_tokens`, the chunk size) and `max_num_seqs` allow: a decoding
sequence one token, a prompt the next chunk that fits what is left of the budget
(engine/sched/scheduler.py). The step's seconds come from the node's fitted cost
(planner/profile_model.py). A prefill node only ever holds prompts; a decode node holds the
sequences whose KV arrived, and the prompts it computes itself (auto's LOCAL placement, a
colocated node). KV capacity: a sequence is admitted when its prompt plus output tokens fit
what the node's resident sequences reserve (no preemption is modelled).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.planner.profile_file import StepSample
from pdserve.planner.profile_model import StepCost
from pdserve.planner.workload import SimRequest


class SeqStage(enum.Enum):
    PROMPT = "prompt"  # its uncached prompt tokens are being computed here
    TRANSFERRING = "transferring"  # computed elsewhere, its KV on the way (holds capacity)
    DECODING = "decoding"
    DONE = "done"


@dataclass
class SimSequence:
    request: SimRequest
    index: int
    prompt_to_compute: int  # the prompt tokens no prefix cache held
    queued_at: float
    stage: SeqStage = SeqStage.PROMPT
    prompt_computed: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return self.request.prompt_tokens - self.prompt_to_compute

    @property
    def prompt_left(self) -> int:
        return self.prompt_to_compute - self.prompt_computed

    @property
    def context(self) -> int:
        return self.request.prompt_tokens + len(self.token_times)

    @property
    def reserved_tokens(self) -> int:
        return self.request.prompt_tokens + self.request.output_tokens


@dataclass
class Step:
    chunks: list[tuple[SimSequence, int]]  # prompts and the tokens of each computed
    decodes: list[SimSequence]
    seconds: float


class SimNode:
    def __init__(
        self,
        name: str,
        cost: StepCost,
        budget: int,
        max_num_seqs: int,
        kv_capacity_tokens: int,
        block_size: int,
    ) -> None:
        self.name = name
        self.cost = cost
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.sequences: list[SimSequence] = []  # resident, in arrival order
        self.waiting_for_kv: list[SimSequence] = []  # not admitted: no room yet
        self.cached_prefixes: set[str] = set()
        self.busy = False
        self.prompt_seconds = 0.0  # time spent in steps that computed prompt tokens

    @property
    def free_tokens(self) -> int:
        return self.kv_capacity_tokens - sum(s.reserved_tokens for s in self.sequences)

    @property
    def num_running(self) -> int:
        return len(self.sequences) + len(self.waiting_for_kv)

    @property
    def prompt_backlog(self) -> int:
        """Prompt tokens queued here and not computed yet."""
        return sum(s.prompt_left for s in (*self.sequences, *self.waiting_for_kv)
                   if s.stage is SeqStage.PROMPT)

    def oldest_waiting_since(self) -> float | None:
        """When the oldest prompt that has not started computing was queued."""
        times = [s.queued_at for s in (*self.sequences, *self.waiting_for_kv)
                 if s.stage is SeqStage.PROMPT and s.prompt_computed == 0]
        return min(times, default=None)

    def cached_tokens(self, request: SimRequest) -> int:
        """The prompt tokens this node's prefix cache likely holds: the shared prefix in whole
        blocks once computed here, always leaving one token to compute."""
        if request.prefix_id is None or request.prefix_id not in self.cached_prefixes:
            return 0
        whole_blocks = request.prefix_tokens // self.block_size * self.block_size
        return min(whole_blocks, request.prompt_tokens - 1)

    def admit(self, seq: SimSequence) -> None:
        self.waiting_for_kv.append(seq)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self.waiting_for_kv and (
            self.waiting_for_kv[0].reserved_tokens <= self.free_tokens or not self.sequences
        ):
            self.sequences.append(self.waiting_for_kv.pop(0))
        self.sequences.sort(key=lambda s: s.index)

    def next_step(self, cost: StepCost | None = None) -> Step | None:
        """The step the scheduler would run now (None: nothing to run); `cost` overrides the
        node's own (a decode node borrowing idle cores)."""
        budget, chunks, decodes = self.budget, [], []
        prefill_tokens = prefill_pairs = decode_context = 0
        for seq in self.sequences:
            if budget == 0 or len(chunks) + len(decodes) == self.max_num_seqs:
                break
            if seq.stage is SeqStage.DECODING:
                decodes.append(seq)
                decode_context += seq.context  # as planner/profile.py counts it
                budget -= 1
            elif seq.stage is SeqStage.PROMPT:
                tokens = min(seq.prompt_left, budget)
                chunks.append((seq, tokens))
                sample = StepSample.prefill(tokens, seq.cached_tokens + seq.prompt_computed, 0)
                prefill_tokens += tokens
                prefill_pairs += sample.prefill_pairs
                budget -= tokens
        if not chunks and not decodes:
            return None
        seconds = (cost or self.cost).seconds(
            prefill_tokens, prefill_pairs, len(decodes), decode_context
        )
        return Step(chunks, decodes, seconds)

    def finish(self, seq: SimSequence) -> None:
        seq.stage = SeqStage.DONE
        (self.sequences if seq in self.sequences else self.waiting_for_kv).remove(seq)
        self._admit_waiting()
