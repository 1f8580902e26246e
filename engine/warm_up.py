"""A node's warm-up: throwaway engine steps before it serves, so that what a first request
would pay once is paid before the node reports ready (node/runtime.py calls
`LLMEngine.warm_up` when it is built)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.engine.sample.sampler import SampleResult
from pdserve.engine.sched.scheduler import ScheduledSequence, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

WARM_UP_MAX_TOKENS = 256
WARM_UP_SHORT_PROMPT_TOKENS = 17
WARM_UP_DECODE_STEPS = 2


def warm_up(engine: LLMEngine, max_tokens: int, kernel_variants: bool | None) -> None:
    """Throwaway steps before a node serves, so that what a first request would pay once
    (Triton kernels compiling on first use, library and allocator set-up) is paid before
    the node reports ready, holding the GIL where no heartbeat is due yet:
      1. a prefill of a throwaway prompt of up to `max_tokens` tokens (and the step
         budget), twice: the first pays the one-time costs, the second is timed, device
         work included, for the prefill speed the node reports to the router
         (router/cluster/queue_delay.py);
      2. with `kernel_variants` (default: on a CUDA device; the CPU stops at 1), the
         steps the first real requests hit next, each kernel variant compiled once: a
         mixed step (that prompt's first decode beside a second, short prompt's prefill,
         sampled with every filter on), a decode batch of both, then the short one's
         decode alone (one token or several; one split of the keys or several).
    It borrows free blocks directly and gives them back, and restores the sampler's
    random state: no request, prefix-cache entry or statistic but the measured speed
    remains. Too few free blocks: it does less."""
    config = engine.config
    if kernel_variants is None:
        kernel_variants = engine.runner.device.type == "cuda"
    decodes_after_prompt = WARM_UP_DECODE_STEPS if kernel_variants else 0
    num_tokens = min(
        max_tokens, config.max_num_batched_tokens, engine.max_model_len - decodes_after_prompt
    )
    if num_tokens < 1:
        return
    borrowed: list[int] = []
    generator = engine.runner.sampler.generator
    generator_state = generator.get_state()
    try:
        long = _warm_up_sequence(
            engine, "warm-up", num_tokens, num_tokens + decodes_after_prompt, borrowed
        )
        if long is None:
            return
        step = SchedulerOutput(scheduled=[ScheduledSequence(long, num_tokens)])
        for measured in (False, True):
            started = time.perf_counter()
            samples = engine.runner.execute(step)
            engine.runner.synchronize()
            if measured:
                engine.preemption.observe_prefill(num_tokens, time.perf_counter() - started)
        if not kernel_variants:
            return
        _advance_warm_up(step, samples)
        short_tokens = min(
            WARM_UP_SHORT_PROMPT_TOKENS,
            config.max_num_batched_tokens - 1,
            engine.max_model_len - WARM_UP_DECODE_STEPS,
        )
        if short_tokens < 1:
            return
        short = _warm_up_sequence(
            engine,
            "warm-up-short",
            short_tokens,
            short_tokens + WARM_UP_DECODE_STEPS,
            borrowed,
            SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=1),
        )
        if short is None:
            return
        for chunks in (
            [(long, 1), (short, short_tokens)],
            [(long, 1), (short, 1)],
            [(short, 1)],
        ):
            step = SchedulerOutput(scheduled=[ScheduledSequence(*c) for c in chunks])
            _advance_warm_up(step, engine.runner.execute(step))
        engine.runner.synchronize()
    finally:
        engine.block_manager.release_blocks(borrowed)
        generator.set_state(generator_state)


def _warm_up_sequence(
    engine: LLMEngine,
    request_id: str,
    num_prompt_tokens: int,
    num_slots: int,
    borrowed: list[int],
    params: SamplingParams | None = None,
) -> Sequence | None:
    """A throwaway sequence with blocks for `num_slots` tokens, borrowed from the free
    list (their ids appended to `borrowed`); None when too few blocks are free."""
    block_ids = engine.block_manager.allocate_blocks(
        engine.block_manager.blocks_for_tokens(num_slots)
    )
    if block_ids is None:
        return None
    borrowed.extend(block_ids)
    vocab_size = engine.model_config.vocab_size
    seq = engine.new_sequence(
        request_id,
        [i % vocab_size for i in range(num_prompt_tokens)],
        params or SamplingParams(temperature=0, max_tokens=1),
    )
    seq.block_table = block_ids
    return seq


def _advance_warm_up(
    step: SchedulerOutput, samples: list[tuple[Sequence, SampleResult]]
) -> None:
    """Marks a warm-up step's chunks computed and appends their sampled tokens."""
    for scheduled in step.scheduled:
        scheduled.seq.num_computed_tokens += scheduled.num_new_tokens
    for seq, sample in samples:
        seq.token_ids.append(sample.token_id)
