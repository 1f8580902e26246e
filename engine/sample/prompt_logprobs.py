"""Prompt logprobs: for every prompt token after the first, its log-probability given the
tokens before it, its rank, and the most likely alternatives at its position (vLLM's
`prompt_logprobs`; the completions API's `echo` with `logprobs` is built on them).

Position p of a prompt (0 <= p < prompt length - 1) scores token p + 1 with the logits the
forward computes at p. Only sequences whose `SamplingParams.prompt_logprobs` is set pay: for
them the model runner asks the model for the logits of their chunk's prompt positions too
(`ScoringPlan.for_step` adds those rows after the sampled ones; a step where no sequence asks
adds none, and decode steps keep their CUDA graphs), then `ScoringPlan.record` takes the
log-softmax in fp32, `SLICE_ROWS` rows at a time so the fp32 copy stays small, and appends each
position's scores to the sequence's `PromptLogprobs`, on the host.

Each position is scored once, in order, whatever happens to its sequence:
  - chunked prefill: each chunk scores its own positions (the prompt's last position is the
    one sampled from, not scored);
  - preemption by recompute: positions already scored are skipped when their chunk runs again;
  - prefix cache: cached positions have no logits, so a sequence that asks takes cached blocks
    only over positions it has already scored (`BlockManager.match_prefix`): a new request
    takes no hit at all, as in vLLM;
  - a step whose batch failed and runs again (engine/llm_engine.py): scores are appended only
    from the next unscored position, so a position is never recorded twice.
The scores leave the engine once, with the first sampled token (`StepOutput.prompt_logprobs`,
from `take()`). A decode node drops them for a request a prefill node computed: that node ran
the prompt and sent them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.sched.scheduler import ScheduledSequence

SLICE_ROWS = 1024  # rows of logits converted to fp32 at once


@dataclass
class PromptTokenLogprobs:
    """The score of one prompt token: its log-probability given the tokens before it, its rank
    in that distribution (1 is the most likely; vLLM's: tokens at least as likely, itself
    included) and the `num_top` most likely tokens there."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    def to_wire(self) -> list:
        """[token_id, logprob, rank, [[id, logprob], ...]], as TokenUpdate.prompt_logprobs
        carries it (one entry per prompt token after the first)."""
        return [self.token_id, self.logprob, self.rank, [[t, v] for t, v in self.top]]


class PromptLogprobs:
    """One sequence's prompt scores, recorded position by position on the host."""

    def __init__(self, num_top: int, num_prompt_tokens: int) -> None:
        self.num_top = num_top
        self.num_positions = num_prompt_tokens - 1
        self.num_scored = 0
        self.taken = False
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def positions_to_score(self, start: int, num_new_tokens: int) -> range:
        """The positions of the chunk [start, start + num_new_tokens) not scored yet."""
        if self.num_scored >= self.num_positions:
            return range(0)
        if start > self.num_scored:
            raise RuntimeError(
                f"a chunk starts at position {start} but only {self.num_scored} prompt "
                "positions are scored: the positions between them would have no logits"
            )
        end = min(start + num_new_tokens, self.num_positions)
        return range(max(start, self.num_scored), max(end, self.num_scored))

    def record(
        self,
        logprobs: torch.Tensor,
        ranks: torch.Tensor,
        top_logprobs: torch.Tensor,
        top_ids: torch.Tensor,
    ) -> None:
        """Appends the scores of the next `len(logprobs)` positions (host tensors)."""
        self._parts.append((logprobs, ranks, top_logprobs, top_ids))
        self.num_scored += len(logprobs)

    def take(self, prompt_token_ids: list[int]) -> list[PromptTokenLogprobs] | None:
        """Every position's scores, the first time it is called once all are recorded; None
        otherwise (they were delivered already)."""
        if self.taken or self.num_scored < self.num_positions:
            return None
        self.taken = True
        parts, self._parts = self._parts, []
        if not parts:
            return []
        logprobs, ranks, top_logprobs, top_ids = (
            torch.cat(column).tolist() for column in zip(*parts)
        )
        return [
            PromptTokenLogprobs(
                prompt_token_ids[position + 1],
                logprobs[position],
                ranks[position],
                list(zip(top_ids[position], top_logprobs[position])),
            )
            for position in range(self.num_positions)
        ]


@dataclass
class _Segment:
    scores: PromptLogprobs
    num_rows: int


@dataclass
class ScoringPlan:
    """The prompt positions one step scores: their rows in the flat token stream (asked of the
    model after the sampled rows), the prompt token each one scores, and whose they are."""

    rows: torch.Tensor
    targets: torch.Tensor
    segments: list[_Segment]

    @classmethod
    def for_step(
        cls, ordered: list[ScheduledSequence], query_start: list[int], device: torch.device
    ) -> ScoringPlan | None:
        """`ordered[i]`'s chunk is the stream's tokens from `query_start[i]`. None when no
        position of the step is to be scored."""
        rows: list[int] = []
        targets: list[int] = []
        segments: list[_Segment] = []
        for i, scheduled in enumerate(ordered):
            seq = scheduled.seq
            scores = seq.prompt_logprobs
            if scores is None:
                continue
            start = seq.num_computed_tokens
            positions = scores.positions_to_score(start, scheduled.num_new_tokens)
            if not positions:
                continue
            rows.extend(query_start[i] + p - start for p in positions)
            targets.extend(seq.token_ids[p + 1] for p in positions)
            segments.append(_Segment(scores, len(positions)))
        if not segments:
            return None
        return cls(
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(targets, dtype=torch.long, device=device),
            segments,
        )

    def record(self, logits: torch.Tensor) -> None:
        """Scores the rows' logits (one per row, in the model's dtype) and records them."""
        row = 0
        for segment in self.segments:
            for start in range(row, row + segment.num_rows, SLICE_ROWS):
                end = min(start + SLICE_ROWS, row + segment.num_rows)
                segment.scores.record(
                    *_score(logits[start:end], self.targets[start:end], segment.scores.num_top)
                )
            row += segment.num_rows


def _score(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_logprobs = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= target_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return (
        target_logprobs.squeeze(1).cpu(),
        ranks.cpu(),
        top_logprobs.cpu(),
        top_ids.cpu(),
    )
