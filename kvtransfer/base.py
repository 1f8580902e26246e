"""The KV transfer interface: a decode-side receiver and a prefill-side sender.

Who calls what, and when (every call comes from the owning node's own thread; each side runs
one I/O thread of its own that owns its socket):

Decode node (`KVReceiver`)
  allocate_kv_cache(spec, num_blocks, device)  once at start-up, before the engine is built: the
                                 KV buffer (in shared memory for shm); the engine runs on it.
  register(kv_cache, model_fingerprint)        once, right after: opens the channel and
                                 returns the `KVDescriptor` the node publishes to prefill nodes.
                                 A tensor-parallel node registers its node cache, every rank's
                                 shard (engine/kv/shared_kv_cache.py), and the prefill node
                                 connects with its own: a transfer moves all ranks' layers.
  expect(transfer_id, block_ids, deadline, budget_s)  when the node has reserved destination
                                 blocks for a request, before it tells the prefill node the
                                 target blocks. With `budget_s`, `deadline` bounds the wait for
                                 the sender's first write (the prompt may still be queued on the
                                 prefill node) and the transfer then has `budget_s` from it.
  abort(transfer_id)             when the request is aborted (client gone, router Abort).
  poll()                         every loop iteration: COMPLETE (all blocks of all layers
                                 arrived; the request may decode), FAILED (deadline passed or
                                 aborted; fail the request now), RELEASED (after FAILED: the
                                 blocks may be freed and reused; no write can land in them any
                                 more).
  wait(transfer_id, timeout)     instead of poll, where the caller blocks (tests, tools).
  close()                        at shutdown.

Prefill node (`KVSender`, one per decode node it writes to)
  connect(descriptor, kv_cache, model_fingerprint)  once per decode node, before the first write;
                                 raises `DescriptorMismatch` naming both values of any field
                                 that differs.
  write(transfer_id, src_block_ids, dst_block_ids, pace_s, layer_start, layer_end)
                                 during or after each prefill chunk's forward, for the blocks
                                 that chunk completes (the last chunk also writes the partial
                                 last block), over the layers computed so far: one write per
                                 layer group as the forward finishes it (prefill_node/node.py),
                                 or every layer (the default, `layer_end` None) after it; with
                                 how long that forward takes (the decode side gives the next
                                 write a few times as long); returns at once, the copy overlaps
                                 the rest of the forward and the next chunk. Each (destination
                                 block, layer) pair is written once per transfer; one block's
                                 layer groups may come in separate writes. The source blocks'
                                 layers must stay unchanged until the transfer's event.
  poll() / wait(transfer_id, timeout)  COMPLETE (the decode node committed the transfer) or
                                 FAILED (refused, rejected, deadline, aborted, decode node gone);
                                 after either, no source block of the transfer is read again.
  abort(transfer_id)             when the request is aborted on the prefill side.
  close()                        at shutdown.

Deadlines belong to the decode side: `expect` sets one (a transfer's own clock starts at its
first write when `expect` gives a budget), the sender learns the seconds left when its first
write is granted, and both sides fail the transfer when it passes, with an error that
names the request (transfer ids are request ids).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

import torch

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer.descriptor import KVDescriptor


class KVTransferError(RuntimeError):
    """A transfer that failed, or a wait that timed out; the message names the request."""


class TransferKind(enum.Enum):
    COMPLETE = "complete"
    FAILED = "failed"
    RELEASED = "released"


@dataclass(frozen=True)
class TransferEvent:
    transfer_id: str
    kind: TransferKind
    error: str | None = None
    block_ids: tuple[int, ...] = ()


class KVReceiver(abc.ABC):
    """Decode side: owns the registered KV buffer and decides what may be written into it."""

    @abc.abstractmethod
    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache: ...

    @abc.abstractmethod
    def register(self, kv_cache: KVCache, model_fingerprint: str) -> KVDescriptor: ...

    @property
    @abc.abstractmethod
    def descriptor(self) -> KVDescriptor: ...

    @abc.abstractmethod
    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        budget_s: float | None = None,
    ) -> None:
        """`deadline` is a time.monotonic() value; block ids must not be held by another
        transfer that is still expected or not yet released. With `budget_s`, the deadline
        ends only the wait for the first write, which restarts the clock with `budget_s`."""

    @abc.abstractmethod
    def abort(self, transfer_id: str) -> None: ...

    @abc.abstractmethod
    def poll(self) -> list[TransferEvent]:
        """New events since the last poll, each reported once."""

    @abc.abstractmethod
    def wait(self, transfer_id: str, timeout: float) -> TransferEvent:
        """Blocks until the transfer is COMPLETE or RELEASED (returned with the FAILED error);
        raises KVTransferError after `timeout` seconds. Consumes that transfer's events."""

    @abc.abstractmethod
    def held_block_count(self) -> int:
        """Blocks of transfers that are expected, or failed and not yet released."""

    @abc.abstractmethod
    def close(self) -> None: ...


class KVSender(abc.ABC):
    """Prefill side: copies or sends blocks of its own KV cache into one decode node's."""

    @abc.abstractmethod
    def connect(
        self, descriptor: KVDescriptor, kv_cache: KVCache, model_fingerprint: str
    ) -> None: ...

    @abc.abstractmethod
    def write(
        self,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        pace_s: float = 0.0,
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> None:
        """Layers `layer_start` up to `layer_end` (None: the last) of the KV buffer connected
        (a tensor-parallel node cache's layers: every rank's, rank-major)."""

    @abc.abstractmethod
    def poll(self) -> list[TransferEvent]:
        """New COMPLETE / FAILED events since the last poll, each reported once."""

    @abc.abstractmethod
    def wait(self, transfer_id: str, timeout: float) -> TransferEvent:
        """Blocks until the transfer is COMPLETE or FAILED; raises KVTransferError after
        `timeout` seconds. Consumes that transfer's event."""

    @abc.abstractmethod
    def abort(self, transfer_id: str) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...
