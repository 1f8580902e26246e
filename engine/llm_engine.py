"""The engine core: requests in, token steps out. No text, no I/O, no threads but the grammar
compiler's (engine/sample/structured_output.py, which holds a request out of the scheduler while its
grammar compiles).

`add_request` validates and queues; each `step()` schedules one iteration, runs it, appends the
sampled tokens, finishes what ended (freeing blocks in the same step) and returns an
`EngineStep`: per-request `StepOutput`s, and the prompt blocks the step filled for requests
whose KV leaves this engine (`export_prompt_blocks`, a prefill node's): a block is exported
once all its tokens are computed (the partial last one with the prompt's last chunk), held
for the caller before the step can end its request, so its KV stays until `release_blocks`;
given an `ExportSink`, a step hands them out by layer group while its forward runs
(engine/prompt_export.py). Nodes and the offline `LLM` drive it in a loop; detokenization and stop strings
live above it (`pdserve.engine.output_processor`), which ends requests through `finish_request`.

A request that breaks a batched step fails alone (engine/step_failure.py). A request with n > 1
choices computes its prompt once and forks into them (engine/forks.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import NoReturn

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.forks import Forks, check_choices
from pdserve.engine.kv.admission import AdmissionPolicy
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.held_blocks import HeldBlocks
from pdserve.engine.kv.layer_group_export import ExportSink, LayerGroupExport
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import model_class
from pdserve.engine.outputs import EngineStep, StepOutput
from pdserve.engine.prompt_checks import check_prompt
from pdserve.engine.prompt_export import PromptExport
from pdserve.engine.runner.model_runner import KVCacheFactory, ModelRunner
from pdserve.engine.sample.prompt_logprobs import PromptTokenLogprobs
from pdserve.engine.sample.sampler import SampleResult, skip_sample
from pdserve.engine.sample.structured_output import StructuredOutput
from pdserve.engine.sched.preemption import PreemptionPolicy
from pdserve.engine.sched.queue_wait import QueueWaitStats
from pdserve.engine.sched.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_failure import StepFailure, find_culprits
from pdserve.engine.warm_up import WARM_UP_MAX_TOKENS, warm_up
from pdserve.text.tokenizer import load_tokenizer
from pdserve.wire.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

logger = logging.getLogger(__name__)


def _resolve_model_path(model: str | None) -> Path:
    if model is None:
        from pdserve.model_store.default_model import ensure_default_model

        return ensure_default_model()
    return Path(model)


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, kv_cache_factory: KVCacheFactory | None = None
    ) -> None:
        """`kv_cache_factory(spec, num_blocks, device)` allocates a one-rank engine's KV cache
        (a decode node passes its KV receiver's, which places the buffer where prefill nodes
        can write); None: the engine's own (engine/runner/model_runner.py)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_path = _resolve_model_path(config.model)
        self.model_config = ModelConfig.from_folder(self.model_path)
        model_class(self.model_config)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        tokenizer_folder = Path(config.tokenizer) if config.tokenizer else self.model_path
        self.tokenizer = (
            load_tokenizer(tokenizer_folder)
            if config.load_format != "dummy" or _has_tokenizer_files(tokenizer_folder)
            else None
        )
        if self.tokenizer is None:
            logger.info("%s has no tokenizer: the engine takes token ids only", tokenizer_folder)
        self.runner = ModelRunner(
            config, self.model_config, self.max_model_len, kv_cache_factory
        )
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_cache_min_blocks,
        )
        kv_spec = self.runner.kv_cache.spec
        self.swap_space = (
            self.runner.new_swap_space(config.swap_space)
            if config.swap_space >= kv_spec.bytes_per_block and config.preemption_mode != "recompute"
            else None
        )
        self.preemption = PreemptionPolicy(
            config.preemption_mode,
            kv_spec.bytes_per_block // config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            preemption=self.preemption,
            swap_space=self.swap_space,
            admission=AdmissionPolicy(
                config.admission, config.block_size, config.admission_quantile
            ),
            priority_aging_s=config.priority_aging_s,
        )
        self.queue_wait = QueueWaitStats()
        self.forks = Forks(self.block_manager, self.scheduler)
        self.num_prompt_tokens_computed = 0
        self.sequences: dict[str, Sequence] = {}
        self.held_blocks = HeldBlocks(self.block_manager)
        self.prompt_export = PromptExport(  # held_blocks' method, not the engine's: no cycle
            self.block_manager, self.model_config.num_layers, self.held_blocks.hold
        )
        self.structured_output = StructuredOutput(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        export_prompt_blocks: bool = False,
        choices: list[tuple[str, SamplingParams]] | None = None,
        group: str | None = None,
    ) -> None:
        """Queues a request (lower `priority` is served first); raises ValueError if it is
        malformed or can never fit. With `export_prompt_blocks` its prompt blocks come out of
        `step()` as they fill (module docstring). With `choices` (id, parameters), its prompt
        is computed once under `request_id` with `params` and forked into one sequence per
        choice, whose outputs carry the choice's id (engine/forks.py). `group` names the client
        request it is part of (several prompts of one API request share it), whose sequences
        share the batch as one request's (engine/sched/request_share.py); None: its own id."""
        if request_id in self.sequences or request_id in self.forks:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        seq = self.new_sequence(request_id, prompt_token_ids, params, priority, arrival_time, group)
        if choices:
            in_use = self.sequences.keys() | self.forks.parent_of.keys()
            check_choices(request_id, choices, in_use, self.config.max_num_seqs)
            for _, choice_params in choices:
                self.validate_prompt(prompt_token_ids, choice_params)
            self.forks.add(seq, [
                self.new_sequence(
                    choice_id, prompt_token_ids, p, priority, seq.arrival_time, seq.group
                )
                for choice_id, p in choices
            ])
        held = not self.structured_output.admit(seq)  # its grammar compiles: scheduled later
        self.sequences[request_id] = seq
        if export_prompt_blocks:
            self.prompt_export.start(request_id)
        if not held:
            self.scheduler.add(seq)

    def new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        group: str | None = None,
    ) -> Sequence:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.model_config.eos_token_ids)
        return Sequence(
            request_id,
            prompt_token_ids,
            params,
            frozenset(stop_ids),
            self.runner.device,
            priority,
            arrival_time,
            group,
        )

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, naming the value, if the request is malformed or can never fit
        (engine/prompt_checks.py)."""
        check_prompt(
            prompt_token_ids,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            self.block_manager,
        )

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, reason: str) -> None:
        """Ends a request now (abort, stop string); its blocks are freed at once. A choice
        not forked yet leaves its prompt, which ends with its last choice."""
        if request_id in self.forks:
            parent = self.forks.drop_child(request_id)
            if parent is not None:
                self.finish_request(parent.request_id, reason)
            return
        seq = self.sequences.pop(request_id, None)
        self.prompt_export.forget(request_id)
        if seq is not None:
            self.forks.forget(seq)
            if self.structured_output.discard(request_id) is not None:
                self._schedule(seq)  # held while its grammar compiled: the scheduler ends it
            self.scheduler.finish(seq, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.structured_output.num_held > 0

    def step(self, export: ExportSink | None = None) -> EngineStep:
        """One iteration. Exported prompt blocks go to `export` where given, by its layer
        groups as the forward computes them (engine/kv/layer_group_export.py; every layer
        after the forward under tensor parallelism); else to the result's `exported_blocks`."""
        ended = self._schedule_compiled() if self.structured_output.num_held else []
        schedule = self.scheduler.schedule()
        self._swap(schedule)
        result = EngineStep(outputs=ended)
        if schedule.is_empty:
            return result
        for scheduled in schedule.scheduled:
            self.queue_wait.observe(scheduled.seq)
        exporting = self.prompt_export.plan(schedule, export, result)
        streams = exporting is not None and export is not None and self.runner.workers is None
        started = time.perf_counter()
        try:
            samples = self.runner.execute(schedule, exporting.layers_done if streams else None)
        except Exception as error:  # noqa: BLE001 (re-raised, or narrowed to its culprits)
            self._fail_step(schedule, exporting, error)
        if exporting is not None:
            exporting.finish()
        num_prefill_tokens = sum(
            s.num_new_tokens for s in schedule.scheduled if s.num_new_tokens > 1
        )
        if self.preemption.measures_prefill(num_prefill_tokens):
            self.runner.synchronize()  # the step's device work, not just its launches
            self.preemption.observe_prefill(num_prefill_tokens, time.perf_counter() - started)
        for scheduled in schedule.scheduled:
            self.num_prompt_tokens_computed += scheduled.num_prompt_tokens
            scheduled.seq.num_computed_tokens += scheduled.num_new_tokens
            self.block_manager.cache_computed_blocks(scheduled.seq)
            seq = scheduled.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # a chunk, not the last
                result.prompt_progress[seq.request_id] = seq.num_computed_tokens - (
                    seq.num_cached_tokens or 0
                )
        forked_scores = self._fork_sampled(samples)
        for seq, sample in samples:
            reason = seq.append_token(sample.token_id)
            if reason is not None:
                self.sequences.pop(seq.request_id, None)
                self.prompt_export.forget(seq.request_id)
                self.scheduler.finish(seq, reason)
            result.outputs.append(
                StepOutput(
                    request_id=seq.request_id,
                    new_token_ids=[sample.token_id],
                    new_logprobs=[sample.logprobs] if sample.logprobs else [],
                    finish_reason=reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens or 0,
                    offset=seq.num_output_tokens - 1,
                    prompt_logprobs=(
                        seq.prompt_logprobs.take(seq.prompt_token_ids)
                        if seq.prompt_logprobs is not None
                        else forked_scores.get(seq.request_id)
                    ),
                )
            )
        return result

    def _fork_sampled(
        self, samples: list[tuple[Sequence, SampleResult]]
    ) -> dict[str, list[PromptTokenLogprobs] | None]:
        """Forks every prompt whose children were sampled in this step and ends it
        (engine/forks.py); returns the prompt's scores for each child, when it asked."""
        scores = {}
        for seq, _ in samples:
            parent = self.forks.parent_of.get(seq.request_id)
            if parent is None:
                continue
            children = parent.children
            parent_scores = self.forks.fork(parent)
            self.sequences.pop(parent.request_id, None)
            self.prompt_export.forget(parent.request_id)
            self.scheduler.finish(parent, "forked")
            for child in children:
                self.sequences[child.request_id] = child
                scores[child.request_id] = parent_scores
        return scores

    def _schedule(self, seq: Sequence) -> None:
        """Hands a sequence that was held while its grammar compiled to the scheduler."""
        if seq.num_computed_tokens:  # its prompt was computed elsewhere (add_prefilled_request)
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq)

    def _schedule_compiled(self) -> list[StepOutput]:
        """Schedules the held sequences whose grammar compiled; ends ("stop") those whose output
        already completes it (a first token sampled elsewhere), returning their outputs; ends
        ("error") those whose grammar failed and raises StepFailure naming them."""
        if not self.scheduler.num_unfinished:
            self.structured_output.wait()  # nothing else to run: no spinning
        ready, failed = self.structured_output.poll()
        for request_id in failed:
            logger.info("request %s: %s", request_id, failed[request_id])
            self.finish_request(request_id, "error")
        if failed:
            raise StepFailure(failed)
        ended = []
        for seq in ready:
            self._schedule(seq)
            if seq.num_output_tokens and seq.grammar.complete:
                self.finish_request(seq.request_id, "stop")
                ended.append(
                    StepOutput(
                        request_id=seq.request_id,
                        new_token_ids=[],
                        new_logprobs=[],
                        finish_reason="stop",
                        num_prompt_tokens=seq.num_prompt_tokens,
                        num_cached_tokens=seq.num_cached_tokens or 0,
                        offset=seq.num_output_tokens,
                    )
                )
        return ended

    def _fail_step(
        self, schedule: SchedulerOutput, exporting: LayerGroupExport | None, error: Exception
    ) -> NoReturn:
        """The step's batch raised `error`: finds its culprits (`_fail_culprits`), settling the
        step's export either way."""
        try:
            self._fail_culprits(schedule.scheduled, schedule.blocks_to_copy, error)
        except StepFailure:
            if exporting is not None:
                self.prompt_export.settle(exporting, others_ran_alone=True)
            raise
        except Exception:
            if exporting is not None:
                self.prompt_export.settle(exporting, others_ran_alone=False)
            raise

    def _fail_culprits(
        self,
        scheduled: list[ScheduledSequence],
        blocks_to_copy: list[tuple[int, int]],
        error: Exception,
    ) -> NoReturn:
        """The step's batch raised `error`: ends the sequences that raise alone and raises
        StepFailure naming them (a parent by its children), or re-raises `error` if none does
        (engine/step_failure.py)."""
        culprits = find_culprits(self.runner, scheduled, blocks_to_copy, error)
        named: dict[str, Exception] = {}
        for request_id, culprit_error in culprits.items():
            logger.error(
                "request %s failed the engine step on its own", request_id, exc_info=culprit_error
            )
            seq = self.sequences[request_id]
            named.update({c.request_id: culprit_error for c in seq.children or [seq]})
            self.finish_request(request_id, "error")
        raise StepFailure(named) from error

    def _swap(self, schedule: SchedulerOutput) -> None:
        """The step's swaps, before anything writes the device blocks a swap-out gave up."""
        if self.swap_space is None:
            return
        for pairs, copy in (
            (schedule.blocks_to_swap_out, self.swap_space.swap_out),
            (schedule.blocks_to_swap_in, self.swap_space.swap_in),
        ):
            if pairs:
                self.preemption.observe_copy(*copy(pairs))
        self.swap_space.free(schedule.host_blocks_to_free)

    # -- blocks held outside sequences (disaggregated serving) -------------------------------

    def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        """Decode side: blocks for a prompt whose KV another node computes, held until
        `add_prefilled_request` takes them or `release_blocks` returns them; None if the
        cache cannot hold them now (engine/kv/held_blocks.py)."""
        return self.held_blocks.reserve(num_tokens)

    def hold_blocks(self, block_ids: list[int]) -> None:
        """Prefill side: keeps blocks (and their KV) while a transfer still reads them."""
        self.held_blocks.hold(block_ids)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.held_blocks.release(block_ids)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_ids: list[int],
        first_token_id: int,
        num_cached_tokens: int = 0,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str | None:
        """Decode side: joins the running batch with the prompt's KV already in `block_ids`
        (reserved here, filled by a transfer) and its first token sampled elsewhere. Returns
        the finish reason if that token already ends the request (its blocks are then freed).
        `arrival_time` is when the request reached this node (its rank in the batch's order).
        With `structured_output`, the grammar follows the first token too: a request whose
        grammar still compiles is held (not scheduled) until it has, and one whose first token
        completes its grammar ends ("stop")."""
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.new_sequence(request_id, prompt_token_ids, params, priority, arrival_time)
        skip_sample(seq, self.model_config.vocab_size)
        seq.prompt_logprobs = None  # the node that ran the prompt scored it
        reason = seq.append_token(first_token_id)
        # Before any block changes hands: admit raises ValueError if it cannot constrain seq.
        held = reason is None and not self.structured_output.admit(seq)
        if reason is None and seq.grammar is not None and seq.grammar.complete:
            reason = "stop"
        self.held_blocks.hand_over(block_ids)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.num_cached_tokens = num_cached_tokens
        seq.first_scheduled_time = seq.arrival_time
        if reason is not None:
            self.block_manager.free(seq)
            return reason
        self.sequences[request_id] = seq
        if not held:
            self.scheduler.add_running(seq)
        return None

    def warm_up(
        self, max_tokens: int = WARM_UP_MAX_TOKENS, kernel_variants: bool | None = None
    ) -> None:
        """Throwaway steps before a node serves (engine/warm_up.py says which and why)."""
        warm_up(self, max_tokens, kernel_variants)

    def close(self) -> None:
        """Stops the engine's worker processes (tensor parallelism: engine/distributed/);
        they also stop when the engine is collected or its process exits."""
        self.runner.close()

    def check_integrity(self) -> None:
        tables = [seq.block_table for seq in self.sequences.values()]
        tables.append(self.held_blocks.elements())
        self.block_manager.check_integrity(tables)
        if self.swap_space is not None:
            self.swap_space.check_integrity(self.scheduler.host_block_tables())
