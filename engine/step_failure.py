"""A request that breaks a batched step fails alone.

Requests are validated before they are queued (SamplingParams, `LLMEngine.validate_prompt`:
engine/prompt_checks.py), so this is the last line. When running a step's batch (forward and
sampling) raises, the engine runs each of that step's sequences alone (`find_culprits`):
  - those that raise alone are ended (finish reason "error", blocks freed) and `step()` raises
    `StepFailure` naming them (a prompt with choices by its choices' ids), for the caller to
    fail just those;
  - every other one is left as it was before the step (its slots allocated, nothing marked
    computed, its seeded generators, its children's too, restored after its lone run) and the
    next `step()` runs it again: rewriting the same KV into the same slots is harmless. Its
    tokens are the ones it would have had (only a failure raised while sampling noise was
    being drawn could have advanced a seeded generator);
  - if none raises alone, the fault is the batch's or the device's, not a request's: the
    original exception propagates and the caller fails every request it holds.
A step of one sequence skips the lone runs: that sequence is the one that failed. A failure
of a tensor-parallel rank (`RankFailure`: it died, hung or broke a collective) is no request's
and propagates at once: the engine is broken. A failure anywhere else in a step (scheduling, swapping, the bookkeeping after the batch ran) is not
attributable and propagates as it is. The lone runs cost one forward per scheduled sequence,
only on this rare path, and never loop: a failure of the re-run batch is judged afresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.distributed.group import RankFailure
from pdserve.engine.sched.scheduler import ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.runner.model_runner import ModelRunner


class StepFailure(Exception):
    """`step()` found the requests that make its batch raise on their own; they are ended in
    the engine. `errors` maps each one's request id to what it raised. Every other request of
    that step runs again on the next `step()`."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        super().__init__(
            f"{len(errors)} request(s) failed the engine step on their own: "
            + "; ".join(f"{rid} ({type(error).__name__}: {error})" for rid, error in errors.items())
        )
        self.errors = errors


def find_culprits(
    runner: ModelRunner,
    scheduled: list[ScheduledSequence],
    blocks_to_copy: list[tuple[int, int]],
    error: Exception,
) -> dict[str, Exception]:
    """The step's batch raised `error`: the sequences of `scheduled` that raise alone, by
    request id, with what they raised; re-raises `error` if none does, or if a rank failed."""
    if isinstance(error, RankFailure):
        raise error
    if len(scheduled) == 1:
        return {scheduled[0].seq.request_id: error}
    culprits: dict[str, Exception] = {}
    for item in scheduled:
        # Every lone run repeats the step's copy-on-write copies (idempotent): the
        # schedule that asked for them is gone, and the re-run will not ask again.
        alone = SchedulerOutput(scheduled=[item], blocks_to_copy=blocks_to_copy)
        generators = [
            row.generator for row in item.seq.children or [item.seq] if row.generator is not None
        ]
        states = [generator.get_state() for generator in generators]
        try:
            runner.execute(alone)
        except Exception as lone_error:  # noqa: BLE001 (whatever it is, it is its own)
            culprits[item.seq.request_id] = lone_error
        finally:
            for generator, state in zip(generators, states):
                generator.set_state(state)
    if not culprits:
        raise error
    return culprits
