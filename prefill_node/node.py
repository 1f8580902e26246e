"""The prefill node: chunked prefill against its radix prefix cache, KV blocks written straight
into the decode node's reserved blocks, the first token to the router at once.

A PrefillRequest comes from a decode node, which already reserved `dst_block_ids` and expects
the transfer until `deadline_s` from now. The node connects a KV sender to that decode node on
first contact (a descriptor mismatch fails the request with a message naming both values) and
queues the prompt (prefill_engine.py). A new descriptor from a known decode node id (the node
was restarted: new channel, new buffer) replaces that node's sender; the old one's transfers
fail. A request then moves through these stages (`Stage`, set in `_enter`; the node loop is
node/runtime.py's):
  PREFILLING   queued or computing; the blocks each step fills are written layer group by
               layer group as its forward computes them (`kv_layers_per_write`; one write
               after the forward under tensor parallelism), so the copy overlaps the rest of
               the forward and the next chunk. An engine error fails it (RequestFailed 500); a
               failed tensor-parallel rank (RankFailure) stops the node instead.
  TOKEN_SENT   its first token went to the router (a TokenUpdate with offset 0) and to the
               decode node (PrefillDone); the prompt's blocks stay in the prefix cache; the last
               writes may still be in flight. After this the decode node alone knows whether its
               KV committed, so a failure here is its to report.
  ABORTING     aborted (the router's Abort, or a failure) after blocks were written: the
               sender's FAILED event, which ends the transfer, releases them.
It ends on its transfer's COMPLETE or FAILED event (a FAILED while PREFILLING is RequestFailed
503 to the router), or at once when aborted before any block was written: its source blocks are
released then. Deadlines: the sender times every stage by the decode node's `deadline_s` (its
FAILED event ends the request); the node itself times none.
A PrefillRequest with `choices` (n > 1) is one request here, under its prompt's id: one
prefill, one transfer. Each choice's first token goes to the router under the choice's id, and
one PrefillDone carries them all; an Abort naming one choice drops it alone (the last one
aborts the request), and a failure is reported once per choice.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.distributed.group import RankFailure
from pdserve.engine.llm_engine import LLMEngine, StepFailure
from pdserve.kvtransfer import ChannelSender, KVDescriptor, KVSender, SenderConfig, TransferKind
from pdserve.kvtransfer.fingerprint import model_fingerprint
from pdserve.node.config import NodeConfig
from pdserve.node.generation import check_request_id, choice_params, step_failure
from pdserve.node.runtime import NodeRuntime, refuse_tensor_parallel_on_gpu
from pdserve.prefill_node.prefill_engine import BlockWrite, FirstToken, PrefillEngine
from pdserve.wire.messages import (
    Abort,
    ChoiceToken,
    PrefillDone,
    PrefillRequest,
    PromptProgress,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
)
from pdserve.wire.node_stats import KvTransferTotals
from pdserve.wire.roles import Role

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    PREFILLING = "prefilling"
    TOKEN_SENT = "first token sent"
    ABORTING = "aborting"


@dataclass
class _Request:
    sender: KVSender
    decode_address: str
    num_prompt_tokens: int
    choice_ids: list[str] = field(default_factory=list)  # n > 1: the choices still wanted
    stage: Stage = Stage.PREFILLING
    first_write_at: float | None = None  # when its transfer started (for its duration)

    def wire_ids(self, request_id: str) -> list[str]:
        """The ids the router knows this request by: its choices', or its own."""
        return list(self.choice_ids) or [request_id]


class PrefillNode(NodeRuntime):
    role = Role.PREFILL

    def __init__(self, *, engine_config: EngineConfig, config: NodeConfig) -> None:
        refuse_tensor_parallel_on_gpu(engine_config, self.role)
        engine = LLMEngine(engine_config)
        super().__init__(engine=engine, config=config)
        self.transport = config.kv_transport
        self.fingerprint = model_fingerprint(engine.model_config)
        self.prefill = PrefillEngine(engine, self._layers_per_write(engine_config, config))
        self.senders: dict[str, tuple[bytes, KVSender]] = {}
        self.requests: dict[str, _Request] = {}
        self.prompt_of: dict[str, str] = {}  # a choice's id -> its request's
        self.transfer_failures = 0
        self.transfer_bytes = 0
        self.transfer_seconds = 0.0

    def _layers_per_write(self, engine_config: EngineConfig, config: NodeConfig) -> int:
        """Layers per KV write: every layer under tensor parallelism, whose ranks finish a
        layer each on its own clock (the write must wait for the slowest, which only the
        step's end knows); else the option; by default a quarter of the model's (rounded up)
        on a GPU, whose copies run beside the forward, and every layer on a CPU, whose copies
        take the cores the forward's later layers need (docs/performance.md)."""
        num_layers = self.engine.model_config.num_layers
        if engine_config.tensor_parallel_size > 1:
            return num_layers
        if config.kv_layers_per_write is not None:
            return min(config.kv_layers_per_write, num_layers)
        if self.engine.runner.device.type == "cpu":
            return num_layers
        return -(-num_layers // 4)

    def kv_transfer_totals(self) -> KvTransferTotals:
        return KvTransferTotals(
            bytes_total=self.transfer_bytes,
            seconds_total=self.transfer_seconds,
            failures_total=self.transfer_failures,
        )

    def busy(self) -> bool:
        return self.prefill.has_work() or bool(self.requests)

    # -- inbound ---------------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, PrefillRequest):
            self._admit(message)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        else:
            super().handle(message)

    def _admit(self, message: PrefillRequest) -> None:
        """Queues the prompt, or fails this request alone, never the node: 400 for what the
        request got wrong (a bad or mismatched descriptor, bad parameters), 503 when no KV
        channel to its decode node can be opened from here (the router retries elsewhere),
        500 for anything else."""
        request_id = message.request_id
        try:
            check_request_id(request_id, self._in_use(request_id))
            params = message.sampling
            choices = choice_params(message, self._in_use)
            sender = self._sender(message.kv_descriptor)
            self.prefill.add(
                request_id,
                message.prompt_token_ids,
                params,
                message.dst_block_ids,
                message.priority,
                choices or None,
                message.group,
            )
        except (ValueError, TypeError) as error:
            logger.info("rejected prefill of %s: %s", request_id, error)
            self.send(RequestFailed(request_id, str(error), 400))
            return
        except ConnectionError as error:
            logger.warning("cannot prefill %s: %s", request_id, error)
            self.send(RequestFailed(request_id, str(error), 503))
            return
        except Exception:
            logger.exception("admitting prefill of %s failed", request_id)
            reason = f"internal error while admitting the prefill of {request_id!r}"
            self.send(RequestFailed(request_id, reason, 500))
            return
        choice_ids = [c for c, _ in choices]
        self.requests[request_id] = _Request(
            sender, message.decode_address, len(message.prompt_token_ids), choice_ids
        )
        self.prompt_of.update((c, request_id) for c in choice_ids)
        logger.info(
            "prefilling %s (%d tokens, %d choices)",
            request_id, len(message.prompt_token_ids), len(choice_ids) or 1,
        )

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.prompt_of

    def _sender(self, encoded_descriptor: bytes) -> KVSender:
        """The sender to the decode node `encoded_descriptor` describes. A decode node whose
        descriptor changed was restarted (new channel, new buffer): its old sender is closed,
        so nothing is ever written into a previous incarnation's buffer. A descriptor this node
        cannot use raises ValueError or TypeError; one the transport cannot attach to from this
        process (a GPU not visible here, a segment gone) raises ConnectionError. Either way the
        new sender is closed and the current one, if any, is kept."""
        descriptor = KVDescriptor.decode(encoded_descriptor)
        current = self.senders.get(descriptor.node_id)
        if current is not None and current[0] == encoded_descriptor:
            return current[1]
        sender = ChannelSender(self.transport, SenderConfig(cluster_auth=self.cluster_auth))
        try:
            sender.connect(descriptor, self.engine.runner.node_kv_cache, self.fingerprint)
        except (ValueError, TypeError):
            sender.close()
            raise
        except Exception as error:  # the transport cannot reach that buffer from this process
            sender.close()
            raise ConnectionError(
                f"cannot open a {self.transport} KV channel to decode node "
                f"{descriptor.node_id!r}: {type(error).__name__}: {error}"
            ) from error
        if current is not None:
            logger.info("decode node %s has a new KV channel; closing the old", descriptor.node_id)
            self._close_sender(current[1])
        self.senders[descriptor.node_id] = (encoded_descriptor, sender)
        return sender

    def _close_sender(self, sender: KVSender) -> None:
        """Closes a sender to a decode node's previous incarnation (its thread stops reading
        our blocks), then ends its requests here; the router fails them for that node."""
        sender.close()
        for request_id, request in list(self.requests.items()):
            if request.sender is sender:
                self.prefill.abort(request_id)
                self._finish(request_id)

    def _abort(self, request_id: str) -> None:
        prompt_id = self.prompt_of.pop(request_id, None)
        if prompt_id is not None:  # one choice: the others go on
            request = self.requests[prompt_id]
            request.choice_ids.remove(request_id)
            self.prefill.abort(request_id)
            if request.choice_ids:
                return
            request_id = prompt_id
        request = self.requests.get(request_id)
        if request is None:
            return
        self.prefill.abort(request_id)
        if self.prefill.blocks_sent(request_id):
            self._enter(request, Stage.ABORTING)
            request.sender.abort(request_id)  # its FAILED event releases the blocks
        else:
            self._finish(request_id)
        logger.info("aborted prefill of %s", request_id)

    def _enter(self, request: _Request, stage: Stage) -> None:
        """Moves a request to `stage` (module docstring; the sender times every stage)."""
        request.stage = stage

    def _write(self, write: BlockWrite, step_started: float) -> None:
        """Hands a layer group of a step's filled blocks to the request's sender, with how long
        the step takes (the decode node paces the transfer's deadline by it,
        kvtransfer/ledger.py): its time so far, scaled to every layer where the forward has
        computed only some."""
        request = self.requests[write.request_id]
        now = time.monotonic()
        if request.first_write_at is None:
            request.first_write_at = now
        spec = self.engine.runner.node_kv_cache.spec
        layer_end = spec.num_layers if write.layer_end is None else write.layer_end
        pace_s = (now - step_started) * spec.num_layers / layer_end
        request.sender.write(
            write.request_id, write.src_block_ids, write.dst_block_ids, pace_s,
            write.layer_start, write.layer_end,
        )
        num_block_layers = len(write.src_block_ids) * (layer_end - write.layer_start)
        self.transfer_bytes += num_block_layers * spec.bytes_per_block_per_layer

    # -- work --------------------------------------------------------------------------------

    def work(self) -> None:
        if self.prefill.has_work():
            self._step()
        for _, sender in self.senders.values():
            for event in sender.poll():
                request = self.requests.get(event.transfer_id)
                if request is None:
                    continue
                if event.kind is TransferKind.FAILED and request.stage is not Stage.ABORTING:
                    self.transfer_failures += 1
                    # After PrefillDone the decode node alone knows whether its KV committed
                    # (a lost Committed message fails only this side); it reports its own
                    # failure by its deadline.
                    if request.stage is Stage.PREFILLING:
                        for wire_id in request.wire_ids(event.transfer_id):
                            self.send(
                                RequestFailed(wire_id, event.error or "KV transfer failed", 503)
                            )
                    self.prefill.abort(event.transfer_id)
                elif event.kind is TransferKind.COMPLETE and request.first_write_at is not None:
                    self.transfer_seconds += time.monotonic() - request.first_write_at
                self._finish(event.transfer_id)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            step = self.prefill.step(lambda write: self._write(write, started))
        except StepFailure as failure:  # these alone; the rest of the step runs again
            for request_id, error in failure.errors.items():
                refusal = step_failure(request_id, error, "prefilling")
                self._fail(self.prompt_of.get(request_id, request_id), refusal.message,
                           refusal.status)
            return
        except RankFailure:  # a tensor-parallel rank is gone: the node stops, as a decode node
            raise
        except Exception:  # fail the requests, keep the node
            logger.exception("prefill step failed")
            for request_id in list(self.requests):
                self._fail(request_id, "engine error while prefilling", 500)
            return
        if step.progress:
            self.send(PromptProgress(self.node_id, step.progress))
        sampled: dict[str, list[FirstToken]] = {}
        for first in step.first_tokens:
            sampled.setdefault(first.prompt_id, []).append(first)
        for prompt_id, firsts in sampled.items():
            self._first_tokens(prompt_id, firsts)

    def _first_tokens(self, prompt_id: str, firsts: list[FirstToken]) -> None:
        """A prompt's first tokens (one per choice) to the router, then PrefillDone."""
        request = self.requests.get(prompt_id)
        if request is None:
            return
        for first in firsts:
            self.prompt_of.pop(first.request_id, None)
            self._first_token(request, first)
        self._enter(request, Stage.TOKEN_SENT)
        first = firsts[0]
        if not request.choice_ids:
            done = PrefillDone(
                prompt_id, first.token_id, _wire_logprobs(first), first.num_cached_tokens
            )
        else:
            done = PrefillDone(
                prompt_id, -1, None, first.num_cached_tokens,
                [ChoiceToken(f.request_id, f.token_id, _wire_logprobs(f)) for f in firsts],
            )
        self.send(done, request.decode_address)

    def _first_token(self, request: _Request, first: FirstToken) -> None:
        logprobs = _wire_logprobs(first)
        update = TokenUpdate(
            request_id=first.request_id,
            token_ids=[first.token_id],
            num_prompt_tokens=request.num_prompt_tokens,
            logprobs=logprobs,
            num_cached_tokens=first.num_cached_tokens,
            offset=0,
            prompt_logprobs=(
                [entry.to_wire() for entry in first.prompt_logprobs]
                if first.prompt_logprobs is not None
                else None
            ),
        )
        self.send(TokenBatch(self.node_id, [update]))

    def _fail(self, request_id: str, message: str, status: int) -> None:
        """Ends a request with an error to the router; its blocks are released now when no
        write of it can still be in flight, else when its transfer's FAILED event comes."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for wire_id in request.wire_ids(request_id):
            self.send(RequestFailed(wire_id, message, status))
        self._abort(request_id)

    def _finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            for choice_id in request.choice_ids:
                self.prompt_of.pop(choice_id, None)
        self.prefill.release(request_id)

    def shutdown(self) -> None:
        for _, sender in self.senders.values():
            sender.close()
        super().shutdown()


def _wire_logprobs(first: FirstToken) -> list | None:
    return [first.logprobs.to_wire()] if first.logprobs is not None else None
