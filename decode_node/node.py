"""The decode node: it decodes prompts that prefill nodes computed (node loop: node/runtime.py).

Its KV cache lives where prefill nodes can write it (the KV receiver allocates and registers it
once, kvtransfer/base.py). A disaggregated request (Generate with a `prefill_address`; one
without is served colocated) moves through these stages (`Stage`), each with its deadline,
all set in `_enter`:
  WAITING_FOR_BLOCKS  queued until `reserve_blocks` finds room for the whole prompt, in the
                      engine's order (priority aged by arrival, engine/sched/sequence_queue.py), not
                      first come first served; deadline: `queue_timeout_s` after arrival, then
                      RequestFailed 503 (the router refuses earlier, by its queue-delay bound).
  TRANSFERRING        the receiver expects the blocks and the prefill node gets a
                      PrefillRequest naming them. The prompt may wait in the prefill node's
                      queue: the receiver allows `queue_timeout_s` for the first write, and the
                      transfer itself then may go `transfer_timeout_s` without a write landing
                      (its clock runs from when prefilling started, and again from each write,
                      paced by how long the write's chunk took: judged by progress,
                      kvtransfer/ledger.py).
  COMMITTED           every block of every layer arrived; waiting for PrefillDone (the first
                      token), which the prefill node sends right after its last chunk;
                      deadline: `transfer_timeout_s` after the commit. Never decodes from
                      partial KV: the request joins the running batch only here, with its
                      first token.
  RELEASING           FAILED (deadline, sender gone, aborted): the router gets RequestFailed
                      503 unless it aborted the request itself; the blocks return to the engine
                      only at RELEASED, when no late write can land in them any more. Aborting
                      a committed transfer returns its blocks at once (nothing can write them).
Then the request runs as in a colocated node (node/generation.py), tokens streamed from offset 1
(the prefill node sent offset 0), with its arrival time here as its rank. A preempted request
recomputes locally; a Generate without `prefill_address` is computed here from the start.
A dead prefill node is noticed by the router, which aborts (and may retry under a new id) its
requests here: blocks never granted to it return at once, granted ones at RELEASED (its
deadline + grace, as it can no longer abandon them). While idle (nothing pending) the node
loop's leak check counts every block still in use as leaked.
A Generate with `choices` (n > 1) goes through these stages once, under its prompt's id: the
prompt's blocks are reserved once, transferred once, and every choice the prefill node sampled
joins with them (engine/forks.py: one reference each, copy-on-write after). Until then an Abort
naming one choice drops it alone (the last one aborts the request), and a failure is reported
once per choice.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.decode_node.borrowed_threads import BorrowedThreads
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer import ChannelReceiver, ReceiverConfig, TransferKind
from pdserve.kvtransfer.fingerprint import model_fingerprint
from pdserve.node.config import NodeConfig
from pdserve.node.generation import Generation, check_request_id, choice_params
from pdserve.node.runtime import IDLE_POLL_MS, NodeRuntime, refuse_tensor_parallel_on_gpu
from pdserve.wire.messages import Abort, Generate, PrefillDone, PrefillRequest, RequestFailed
from pdserve.wire.node_stats import KvTransferTotals, SchedulingStats, TokenTotals
from pdserve.wire.roles import Role
from pdserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TRANSFER_POLL_MS = 1


class Stage(enum.Enum):
    WAITING_FOR_BLOCKS = "waiting for blocks"
    TRANSFERRING = "transferring"
    COMMITTED = "committed"
    RELEASING = "releasing"


@dataclass
class PendingPrefill:
    message: Generate
    params: SamplingParams
    arrived: float
    rank: tuple[float, ...]
    stage: Stage = Stage.WAITING_FOR_BLOCKS
    deadline: float | None = None  # of a stage the node itself times (None: the receiver's)
    block_ids: list[int] = field(default_factory=list)
    first: PrefillDone | None = None
    choices: list[tuple[str, SamplingParams]] = field(default_factory=list)  # still wanted

    def wire_ids(self) -> list[str]:
        """The ids the router knows this request by: its choices', or its own."""
        return [c for c, _ in self.choices] or [self.message.request_id]


class DecodeNode(NodeRuntime):
    role = Role.DECODE

    def __init__(self, *, engine_config: EngineConfig, config: NodeConfig) -> None:
        refuse_tensor_parallel_on_gpu(engine_config, self.role)
        self.receiver = ChannelReceiver(
            config.kv_transport,
            ReceiverConfig(
                node_id=config.node_id,
                bind_address=config.kv_listen_address,
                cluster_auth=config.cluster_auth,
            ),
        )
        one_rank = engine_config.tensor_parallel_size == 1  # else the engine's own node cache
        engine = LLMEngine(
            engine_config, kv_cache_factory=self.receiver.allocate_kv_cache if one_rank else None
        )
        super().__init__(engine=engine, config=config)
        self.generation = Generation(engine, config.node_id)
        self.fingerprint = model_fingerprint(engine.model_config)
        self.descriptor = self.receiver.register(engine.runner.node_kv_cache, self.fingerprint)
        self.transfer_timeout_s = config.transfer_timeout_s
        self.queue_timeout_s = config.queue_timeout_s
        self.pending: dict[str, PendingPrefill] = {}
        self.prompt_of: dict[str, str] = {}  # a pending choice's id -> its request's
        self.waiting_for_blocks: list[tuple[tuple[float, ...], str]] = []  # sorted by rank
        self._arrival_numbers = itertools.count()
        self._next_deadline = float("inf")  # no stage deadline of `pending` is earlier
        self.preallocation_wait_s = 0.0
        self.transfer_failures = 0
        self.threads = BorrowedThreads(
            engine_config.num_threads, config.threads_while_prefill_idle
        )

    def scheduling_stats(self) -> SchedulingStats:
        """The engine's, with the requests waiting for blocks or their transfer counted as
        waiting."""
        stats = super().scheduling_stats()
        return replace(stats, num_waiting=stats.num_waiting + len(self.pending))

    def token_totals(self) -> TokenTotals:
        return self.generation.token_totals()

    def kv_transfer_totals(self) -> KvTransferTotals:
        return KvTransferTotals(
            failures_total=self.transfer_failures,
            preallocation_wait_seconds_total=self.preallocation_wait_s,
        )

    def idle(self) -> bool:
        return not self.pending and super().idle()

    def poll_timeout_ms(self) -> int:
        if self.busy():
            return 0
        return TRANSFER_POLL_MS if self.pending else IDLE_POLL_MS

    # -- stages ------------------------------------------------------------------------------

    def _enter(self, request_id: str, pending: PendingPrefill, stage: Stage, now: float) -> None:
        """Moves a request to `stage` and sets that stage's deadline (module docstring)."""
        pending.stage = stage
        pending.deadline = None
        if stage is Stage.WAITING_FOR_BLOCKS:
            pending.deadline = pending.arrived + self.queue_timeout_s
            bisect.insort(self.waiting_for_blocks, (pending.rank, request_id))
        elif stage is Stage.TRANSFERRING:
            self.preallocation_wait_s += now - pending.arrived
            self.receiver.expect(
                request_id,
                pending.block_ids,
                now + self.queue_timeout_s,
                budget_s=self.transfer_timeout_s,
            )
        elif stage is Stage.COMMITTED:
            pending.deadline = now + self.transfer_timeout_s
        if pending.deadline is not None:
            self._next_deadline = min(self._next_deadline, pending.deadline)

    def _expire(self, now: float) -> None:
        """Fails the requests whose stage's deadline passed (the receiver times TRANSFERRING)."""
        if now < self._next_deadline:
            return
        self._next_deadline = min(
            (p.deadline for p in self.pending.values() if p.deadline and p.deadline > now),
            default=float("inf"),
        )
        for request_id, pending in list(self.pending.items()):
            if pending.deadline is None or now < pending.deadline:
                continue
            if pending.stage is Stage.WAITING_FOR_BLOCKS:
                self.waiting_for_blocks.remove((pending.rank, request_id))
                self._forget(request_id)
                self._fail(pending, f"no KV blocks free for request {request_id} in time")
            elif pending.stage is Stage.COMMITTED:
                self._drop_committed(request_id)
                self._fail(pending, f"no first token for request {request_id} in time")

    # -- inbound ---------------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, Generate) and message.prefill_address:
            self._admit_disaggregated(message)
        elif isinstance(message, PrefillDone):
            pending = self.pending.get(message.request_id)
            if pending is not None and pending.first is None:
                pending.first = message
                self._join_when_ready(message.request_id)
        elif isinstance(message, Abort) and message.request_id in self.prompt_of:
            self._abort_choice(message.request_id)
        elif isinstance(message, Abort) and message.request_id in self.pending:
            self._abort_pending(message.request_id)
        elif isinstance(message, Abort):
            self.generation.abort(message.request_id)
        elif isinstance(message, Generate):
            refusal = self.generation.admit(message)
            if refusal is not None:
                self.send(refusal)
        else:
            super().handle(message)

    def _admit_disaggregated(self, message: Generate) -> None:
        request_id = message.request_id
        try:
            check_request_id(request_id, self._in_use(request_id))
            params = message.sampling
            choices = choice_params(message, self._in_use)
            for _, choice in choices:
                self.engine.validate_prompt(message.prompt_token_ids, choice)
            self.engine.validate_prompt(message.prompt_token_ids, params)
        except (ValueError, TypeError, OverflowError) as error:
            logger.info("rejected request %s: %s", request_id, error)
            self.send(RequestFailed(request_id, str(error), 400))
            return
        now = time.monotonic()
        order = self.engine.scheduler.waiting.order
        rank = order.rank_of(message.priority, now, next(self._arrival_numbers))
        pending = PendingPrefill(message, params, now, rank, choices=choices)
        self.pending[request_id] = pending
        self.prompt_of.update((c, request_id) for c, _ in choices)
        self._enter(request_id, pending, Stage.WAITING_FOR_BLOCKS, now)
        self.generation.prompt_tokens_total += len(message.prompt_token_ids)

    def _in_use(self, request_id: str) -> bool:
        return (
            request_id in self.pending
            or request_id in self.prompt_of
            or self.generation.in_use(request_id)
        )

    def _abort_choice(self, choice_id: str) -> None:
        """Drops one choice of a pending request; the last one aborts the request."""
        request_id = self.prompt_of.pop(choice_id)
        pending = self.pending[request_id]
        pending.choices = [c for c in pending.choices if c[0] != choice_id]
        if not pending.choices:
            self._abort_pending(request_id)

    def _abort_pending(self, request_id: str) -> None:
        pending = self.pending[request_id]
        if pending.stage is Stage.WAITING_FOR_BLOCKS:
            self.waiting_for_blocks.remove((pending.rank, request_id))
            self._forget(request_id)
        elif pending.stage is Stage.COMMITTED:
            self._drop_committed(request_id)
        elif pending.stage is Stage.TRANSFERRING:
            self._enter(request_id, pending, Stage.RELEASING, time.monotonic())
            self.receiver.abort(request_id)  # its blocks come back at RELEASED
        logger.info("aborted request %s before it joined the batch", request_id)

    def _drop_committed(self, request_id: str) -> None:
        """A committed transfer has no writer left: its blocks can return at once."""
        pending = self._forget(request_id)
        self.engine.release_blocks(pending.block_ids)

    # -- work --------------------------------------------------------------------------------

    def work(self) -> None:
        for event in self.receiver.poll():
            self._on_transfer_event(event)
        now = time.monotonic()
        self._expire(now)
        self._reserve_blocks(now)
        self.threads.update(
            prefilling=any(p.stage is Stage.TRANSFERRING for p in self.pending.values())
        )
        for message in self.generation.step():
            self.send(message)

    def _reserve_blocks(self, now: float) -> None:
        """Reserves blocks for the waiting requests in rank order; the first that does not fit
        stops the pass (no smaller request overtakes it, so none starves)."""
        while self.waiting_for_blocks:
            _, request_id = self.waiting_for_blocks[0]
            pending = self.pending[request_id]
            prompt = pending.message.prompt_token_ids
            block_ids = self.engine.reserve_blocks(len(prompt))
            if block_ids is None:
                return
            self.waiting_for_blocks.pop(0)
            pending.block_ids = block_ids
            wanted = {c for c, _ in pending.choices}
            self._enter(request_id, pending, Stage.TRANSFERRING, now)
            self.send(
                PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=pending.message.sampling,
                    dst_block_ids=block_ids,
                    decode_address=self.advertise_address,
                    kv_descriptor=self.descriptor.encode(),
                    deadline_s=self.transfer_timeout_s,
                    priority=pending.message.priority,
                    choices=[c for c in pending.message.choices if c.request_id in wanted],
                    group=pending.message.group,
                ),
                pending.message.prefill_address,
            )

    def _on_transfer_event(self, event: Any) -> None:
        request_id = event.transfer_id
        pending = self.pending.get(request_id)
        if pending is None:
            return
        if event.kind is TransferKind.COMPLETE:
            if pending.stage is Stage.RELEASING:  # aborted while its commit was reported:
                self._drop_committed(request_id)  # nothing writes into the blocks any more
                return
            self._enter(request_id, pending, Stage.COMMITTED, time.monotonic())
            self._join_when_ready(request_id)
        elif event.kind is TransferKind.FAILED:
            if pending.stage is Stage.TRANSFERRING:
                self._enter(request_id, pending, Stage.RELEASING, time.monotonic())
                self.transfer_failures += 1
                self._fail(pending, event.error or "KV transfer failed")
        else:
            self._forget(request_id)
            self.engine.release_blocks(pending.block_ids)

    def _join_when_ready(self, request_id: str) -> None:
        pending = self.pending[request_id]
        if pending.stage is not Stage.COMMITTED or pending.first is None:
            return
        self._forget(request_id)
        try:
            batch = self.generation.join(
                pending.message, pending.params, pending.block_ids, pending.first, pending.arrived,
                pending.choices if pending.message.choices else None,
            )
        except ValueError as error:
            self.engine.release_blocks(pending.block_ids)
            self._fail(pending, f"cannot join the batch: {error}", 500)
            return
        if batch is not None:
            self.send(batch)

    def _fail(self, pending: PendingPrefill, message: str, status: int = 503) -> None:
        logger.warning("request %s failed: %s", pending.message.request_id, message)
        for wire_id in pending.wire_ids():
            self.send(RequestFailed(wire_id, message, status))

    def _forget(self, request_id: str) -> PendingPrefill:
        """Takes a request out of `pending`, with its choices."""
        pending = self.pending.pop(request_id)
        for choice_id, _ in pending.choices:
            self.prompt_of.pop(choice_id, None)
        return pending

    def shutdown(self) -> None:
        self.receiver.close()
        super().shutdown()
