"""n choices of one prompt: the prompt computed once, then forked into the choices.

A request with choices (`LLMEngine.add_request(..., choices=...)`, the API's `n` > 1) enters
the engine as one *parent* sequence, the prompt under the request's id, carrying a *child*
sequence per choice (`Sequence.children`: each with its own id, sampling parameters and seeded
generator). Its lifecycle:
  prompt    only the parent is scheduled, chunk by chunk like any prompt (it counts as n
            sequences against `max_num_seqs`; preempting it cures it like any other); aborting
            a child removes it from the parent, aborting the last one (or the request's id)
            ends the parent.
  fork      the step whose chunk completes the prompt samples its last position's logits once
            per child, each with the child's own parameters and generator (runner/model_runner.py),
            so each child's first token is the one a lone request with its settings draws.
            `fork` then gives every child the parent's blocks (one reference per child,
            `BlockManager.fork`) and the parent's computed prompt, joins it to the running
            batch, and the parent ends: the prompt's blocks are now the children's alone.
  children  ordinary sequences from here on. They share the prompt's blocks; the partial last
            block is copied on write by each child that appends to it while others still hold
            it (the scheduler's `copy_on_write`, counted by the block manager). A child may
            finish, be aborted or be preempted alone; a child preempted by recompute
            prefills its own prompt again (the prefix cache may serve it).
Decode side (`join_prefilled_choices`): a prompt computed by a prefill node arrives with one
first token per child; every child joins with the transferred blocks, one reference each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sample.prompt_logprobs import PromptTokenLogprobs
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


def check_choices(
    request_id: str,
    choices: list[tuple[str, SamplingParams]],
    in_use: set[str] | dict[str, object],
    max_num_seqs: int,
) -> None:
    """ValueError for choices this engine cannot fork: ids in use, repeated or equal to the
    request's, more of them than `max_num_seqs`, or structured output (not forked)."""
    ids = [choice_id for choice_id, _ in choices]
    if len(set(ids)) != len(ids) or request_id in ids:
        raise ValueError(f"request {request_id!r}: its choices' ids must be distinct, got {ids}")
    taken = next((i for i in ids if i in in_use), None)
    if taken is not None:
        raise ValueError(f"request id {taken!r} is already in use")
    if len(choices) > max_num_seqs:
        raise ValueError(
            f"request {request_id!r} has {len(choices)} choices; this engine runs at most "
            f"{max_num_seqs} sequences at once (max_num_seqs)"
        )
    if any(params.structured_output is not None for _, params in choices):
        raise ValueError(
            "structured_output is not supported for choices forked from one prompt; "
            "send them as separate requests"
        )


class Forks:
    """The parents whose prompt is still being computed, and their children by id."""

    def __init__(self, block_manager: BlockManager, scheduler: Scheduler) -> None:
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.parent_of: dict[str, Sequence] = {}  # child id -> parent, until the fork

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.parent_of

    def add(self, parent: Sequence, children: list[Sequence]) -> None:
        parent.children = children
        for child in children:
            self.parent_of[child.request_id] = parent

    def drop_child(self, child_id: str) -> Sequence | None:
        """Removes a child before the fork; returns its parent if it has no child left (for
        the caller to end), else None."""
        parent = self.parent_of.pop(child_id, None)
        if parent is None:
            return None
        parent.children = [c for c in parent.children if c.request_id != child_id]
        return None if parent.children else parent

    def forget(self, parent: Sequence) -> None:
        """The parent ends before its fork: its children go with it."""
        for child in parent.children:
            self.parent_of.pop(child.request_id, None)
        parent.children = []

    def fork(self, parent: Sequence) -> list[PromptTokenLogprobs] | None:
        """The parent's prompt is computed and its children's first tokens sampled: each
        child takes the parent's blocks and computed prompt and joins the running batch. The
        caller ends the parent (dropping its own references) and appends the tokens. Returns
        the prompt's scores when it asked for them (every child delivers them)."""
        children = parent.children
        scores: list[PromptTokenLogprobs] | None = None
        if parent.prompt_logprobs is not None:
            scores = parent.prompt_logprobs.take(parent.prompt_token_ids)
        for child in children:
            self.parent_of.pop(child.request_id, None)
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_blocks_offered = parent.num_blocks_offered
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            child.prompt_logprobs = None  # the parent scored the prompt: `scores`
            self.scheduler.add_running(child)
        parent.children = []
        return scores


def join_prefilled_choices(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: list[int],
    choices: list[tuple[str, SamplingParams, int]],
    block_ids: list[int],
    num_cached_tokens: int = 0,
    priority: int = 0,
    arrival_time: float | None = None,
) -> dict[str, str | None]:
    """Decode side: the children (id, parameters, first token) of a prompt another node
    computed into `block_ids` join the running batch, each holding one reference on those
    blocks (the fork after the join). Returns each child's finish reason (None: it runs).
    ValueError if one cannot join: the children joined so far are aborted, and the caller
    still owns `block_ids` (one reference) as before."""
    check_choices(request_id, [(c, p) for c, p, _ in choices], engine.sequences, len(choices))
    engine.hold_blocks(block_ids * (len(choices) - 1))  # a reference per further child
    reasons: dict[str, str | None] = {}
    for index, (choice_id, params, first_token_id) in enumerate(choices):
        try:
            reasons[choice_id] = engine.add_prefilled_request(
                choice_id, prompt_token_ids, params, block_ids, first_token_id,
                num_cached_tokens, priority, arrival_time,
            )
        except ValueError:
            engine.release_blocks(block_ids * (len(choices) - 1 - index))
            for joined, reason in reasons.items():
                if reason is None:
                    engine.abort_request(joined)
            raise
    return reasons
