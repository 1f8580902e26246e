"""The decode node: a colocated node whose prompts are computed by prefill nodes.

Its KV cache lives where prefill nodes can write it (the KV receiver allocates and registers it
once, kvtransfer/base.py). Lifecycle of a disaggregated request (Generate with a
`prefill_address`; one without is served colocated):
  waiting for blocks  queued until `reserve_blocks` finds room for the whole prompt; deadline:
                      `transfer_timeout_s` after arrival, then RequestFailed 503.
  transferring        the receiver expects the blocks until `transfer_timeout_s` from now, and
                      the prefill node gets a PrefillRequest naming them. The request joins
                      the running batch only when the transfer is COMPLETE (every block of every
                      layer arrived) and PrefillDone brought its first token; never from a
                      partial transfer.
  failed              FAILED (deadline, sender gone, aborted): the router gets RequestFailed
                      503 unless it aborted the request itself; the blocks return to the engine
                      only at RELEASED, when no late write can land in them any more. A
                      committed transfer whose first token does not come within
                      `transfer_timeout_s` of arrival fails too; aborting a committed
                      transfer returns its blocks at once (nothing can write them).
  running             as in a colocated node, tokens streamed from offset 1 (the prefill node
                      sent offset 0). A preempted request recomputes locally.
A dead prefill node is noticed by the router, which aborts (and may retry under a new id) its
requests here: blocks never granted to it return at once, granted ones at RELEASED (its
deadline + grace, as it can no longer abandon them). While idle (nothing pending) the node
loop's leak check counts every block still in use as leaked.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decode_node.colocated import ColocatedNode, build_engine
from engine.cluster_auth import ClusterAuth
from engine.config import EngineConfig
from engine.node_runtime import IDLE_POLL_MS
from engine.protocol import (
    Abort,
    Generate,
    PrefillDone,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
)
from engine.sampling_params import SamplingParams
from kvtransfer import ChannelReceiver, ReceiverConfig, TransferKind
from kvtransfer.fingerprint import model_fingerprint

logger = logging.getLogger(__name__)

TRANSFER_POLL_MS = 1


@dataclass
class PendingPrefill:
    message: Generate
    params: SamplingParams
    arrived: float
    block_ids: list[int] | None = None
    first: PrefillDone | None = None
    complete: bool = False
    failed: bool = False


class DecodeNode(ColocatedNode):
    role = "decode"

    def __init__(
        self,
        engine_config: EngineConfig | Mapping[str, Any],
        node_id: str,
        listen_address: str,
        router_address: str,
        transport: str,
        kv_bind_address: str = "tcp://127.0.0.1:0",
        transfer_timeout_s: float = 30.0,
        heartbeat_interval: float = 0.5,
        advertise_address: str | None = None,
        cluster_auth: ClusterAuth | None = None,
    ) -> None:
        self.receiver = ChannelReceiver(
            transport,
            ReceiverConfig(
                node_id=node_id,
                bind_address=kv_bind_address,
                cluster_auth=cluster_auth or ClusterAuth.none(),
            ),
        )
        engine = build_engine(engine_config, kv_cache_factory=self.receiver.allocate_kv_cache)
        super().__init__(
            engine, node_id, listen_address, router_address, heartbeat_interval, advertise_address,
            cluster_auth=cluster_auth,
        )
        self.fingerprint = model_fingerprint(engine.model_config)
        self.descriptor = self.receiver.register(engine.runner.kv_cache, self.fingerprint)
        self.transfer_timeout_s = transfer_timeout_s
        self.pending: dict[str, PendingPrefill] = {}
        self.waiting_for_blocks: collections.deque[str] = collections.deque()
        self.preallocation_wait_s = 0.0
        self.transfer_failures = 0

    def stats_fields(self) -> dict[str, Any]:
        return {
            **super().stats_fields(),
            "num_waiting": len(self.engine.scheduler.waiting) + len(self.pending),
            "model_fingerprint": self.fingerprint,
            "kv_transfer_failures_total": self.transfer_failures,
            "preallocation_wait_seconds_total": self.preallocation_wait_s,
        }

    def idle(self) -> bool:
        return not self.pending and super().idle()

    def poll_timeout_ms(self) -> int:
        if self.busy():
            return 0
        return TRANSFER_POLL_MS if self.pending else IDLE_POLL_MS

    # -- inbound ---------------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, Generate) and message.prefill_address:
            self._admit_disaggregated(message)
        elif isinstance(message, PrefillDone):
            pending = self.pending.get(message.request_id)
            if pending is not None:
                pending.first = message
                self._join_when_ready(message.request_id)
        elif isinstance(message, Abort) and message.request_id in self.pending:
            self._abort_pending(message.request_id)
        else:
            super().handle(message)

    def _admit_disaggregated(self, message: Generate) -> None:
        request_id = message.request_id
        try:
            if request_id in self.pending or request_id in self.engine.sequences:
                raise ValueError(f"request id {request_id!r} is already in use")
            params = SamplingParams(**message.sampling)
            self.engine.validate_prompt(message.prompt_token_ids, params)
        except (ValueError, TypeError) as error:
            logger.info("rejected request %s: %s", request_id, error)
            self.send(RequestFailed(request_id, str(error), 400))
            return
        self.pending[request_id] = PendingPrefill(message, params, time.monotonic())
        self.waiting_for_blocks.append(request_id)
        self.prompt_tokens_total += len(message.prompt_token_ids)

    def _abort_pending(self, request_id: str) -> None:
        pending = self.pending[request_id]
        pending.failed = True
        if pending.block_ids is None:
            self.waiting_for_blocks.remove(request_id)
            del self.pending[request_id]
        elif pending.complete:
            self._drop_complete(request_id)
        else:
            self.receiver.abort(request_id)  # its blocks come back at RELEASED
        logger.info("aborted request %s before it joined the batch", request_id)

    def _drop_complete(self, request_id: str) -> None:
        """A committed transfer has no writer left: its blocks can return at once."""
        pending = self.pending.pop(request_id)
        self.engine.release_blocks(pending.block_ids)

    # -- work --------------------------------------------------------------------------------

    def work(self) -> None:
        self._reserve_blocks()
        for event in self.receiver.poll():
            self._on_transfer_event(event)
        self._expire_first_tokens()
        super().work()

    def _expire_first_tokens(self) -> None:
        """A committed transfer whose first token never came (the prefill node died after
        writing) fails once `transfer_timeout_s` has passed since the request arrived."""
        now = time.monotonic()
        for request_id, pending in list(self.pending.items()):
            late = now - pending.arrived > self.transfer_timeout_s
            if pending.complete and pending.first is None and late:
                self._drop_complete(request_id)
                self._fail(request_id, f"no first token for request {request_id} in time")

    def _reserve_blocks(self) -> None:
        now = time.monotonic()
        while self.waiting_for_blocks:
            request_id = self.waiting_for_blocks[0]
            pending = self.pending[request_id]
            prompt = pending.message.prompt_token_ids
            if now - pending.arrived > self.transfer_timeout_s:
                self.waiting_for_blocks.popleft()
                del self.pending[request_id]
                self._fail(request_id, f"no KV blocks free for request {request_id} in time")
                continue
            block_ids = self.engine.reserve_blocks(len(prompt))
            if block_ids is None:
                return
            self.waiting_for_blocks.popleft()
            pending.block_ids = block_ids
            self.preallocation_wait_s += now - pending.arrived
            self.receiver.expect(request_id, block_ids, now + self.transfer_timeout_s)
            self.send(
                PrefillRequest(
                    request_id,
                    prompt,
                    pending.message.sampling,
                    block_ids,
                    self.advertise_address,
                    self.descriptor.encode(),
                    self.transfer_timeout_s,
                    pending.message.priority,
                ),
                pending.message.prefill_address,
            )

    def _on_transfer_event(self, event: Any) -> None:
        pending = self.pending.get(event.transfer_id)
        if pending is None:
            return
        if event.kind is TransferKind.COMPLETE:
            pending.complete = True
            if pending.failed:  # aborted while its commit was being reported: nothing writes
                self._drop_complete(event.transfer_id)  # into the blocks any more
            else:
                self._join_when_ready(event.transfer_id)
        elif event.kind is TransferKind.FAILED:
            if not pending.failed:
                pending.failed = True
                self.transfer_failures += 1
                self._fail(event.transfer_id, event.error or "KV transfer failed")
        else:
            del self.pending[event.transfer_id]
            self.engine.release_blocks(pending.block_ids)

    def _join_when_ready(self, request_id: str) -> None:
        pending = self.pending[request_id]
        if not (pending.complete and pending.first) or pending.failed:
            return
        del self.pending[request_id]
        message, first = pending.message, pending.first
        try:
            reason = self.engine.add_prefilled_request(
                request_id,
                message.prompt_token_ids,
                pending.params,
                pending.block_ids,
                first.token_id,
                first.num_cached_tokens,
                pending.message.priority,
            )
        except ValueError as error:
            self.engine.release_blocks(pending.block_ids)
            self._fail(request_id, f"cannot join the batch: {error}", 500)
            return
        self.generation_tokens_total += 1
        if reason is not None:
            update = TokenUpdate(
                request_id,
                [],
                reason,
                len(message.prompt_token_ids),
                None,
                first.num_cached_tokens,
                offset=1,
            )
            self.send(TokenBatch(self.node_id, [update]))
            return
        self.active.add(request_id)

    def _fail(self, request_id: str, message: str, status: int = 503) -> None:
        logger.warning("request %s failed: %s", request_id, message)
        self.send(RequestFailed(request_id, message, status))

    def shutdown(self) -> None:
        self.receiver.close()
