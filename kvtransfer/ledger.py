"""The decode side's book of expected transfers: what may be written where, when a transfer is
complete, and when its blocks may be given back.

A transfer moves through these states; each has a deadline:
  expected   `expect()` registered its destination blocks and deadline. The first sender whose
             Begin arrives is granted it; writes from any other sender are dropped. With a
             `budget_s`, the transfer is judged by its progress, not by one wall-clock bound:
             the deadline given to `expect()` bounds only the wait for that first Begin (the
             prompt may sit in the prefill node's queue meanwhile); the grant moves the
             deadline to the grant time plus `budget_s`, and every accepted write moves it to
             its arrival plus the larger of `budget_s` and PACE_FACTOR times its `pace_s` (how
             long the prefill step that filled its blocks took: the next chunk's forward is
             about as long). A prompt prefilled in many chunks on a busy host then has that
             long for each chunk, not `budget_s` for the whole prompt, however slow the host;
             a sender that stops writing fails that long after its last write. Each write's
             Ack carries the seconds left, so the sender's deadline follows
             (kvtransfer/sender.py).
  complete   every (block, layer) pair arrived: COMPLETE is reported and the ledger forgets the
             transfer (the owner keeps the blocks).
  failed     the deadline passed, the owner aborted, or the sender abandoned it: FAILED is
             reported at once and its blocks stay held.
  released   RELEASED is reported: the owner may free and reuse the blocks.

Writes for an unknown, complete, failed or released transfer, or to blocks outside its set, are
refused before any byte is written (one for a complete transfer can only repeat a write that
landed, so the receiver drops it without failing the sender's transfer).

Late-write rule (the transport's write strategy, kvtransfer/strategies.py, says which half
applies). Where the receiver scatters every byte itself (Streamed: zmq), a failed transfer is
released at once: its I/O thread checks the ledger before each scatter, so nothing lands after.
Where the sender copies into our memory itself (DirectWrite: shm, cuda_ipc, mooncake,
inprocess), a failed transfer that was granted is released only when (a) its sender sends
Abandon, which it does after its last copy for the transfer has finished and never copies for it
again (never after a copy that raised: a timed-out network write may still be landing), or (b)
`release_grace_s` after the deadline (or the strategy's `write_timeout_s`, where longer: a
network write's bound). (b) holds because a sender's deadline is never later than ours (it is
the time it sent Begin, or a write we acknowledged, plus the seconds left we named in reply)
and it starts no copy step after it, and one step is a few MiB, far shorter than the grace. A failed transfer never
granted is released at once: no sender may write it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer.base import TransferEvent, TransferKind
from pdserve.kvtransfer.messages import MAX_TRANSFER_ID_CHARS, Cancel, Committed
from pdserve.kvtransfer.strategies import WriteStrategy

RECENT_TRANSFERS_REMEMBERED = 4096
# A chunk's forward may take this many times as long as the one before it (a longer context,
# a host getting busier) before its transfer counts as stalled.
PACE_FACTOR = 3.0


@dataclass
class ExpectedTransfer:
    transfer_id: str
    block_ids: tuple[int, ...]
    deadline: float
    budget_s: float
    missing_layers: dict[int, int]
    num_missing: int
    writer: bytes | None = None
    error: str | None = None
    release_at: float | None = None
    paced_by_writes: bool = False
    stall_bound_s: float = 0.0  # paced: how long it may now go without a write
    block_set: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.block_set = frozenset(self.block_ids)


class TransferLedger:
    """Not thread-safe: the receiver guards it with one lock. Methods queue events for the owner
    and notices for senders; `take_actions()` hands them over."""

    def __init__(
        self, num_blocks: int, num_layers: int, strategy: WriteStrategy, release_grace_s: float
    ) -> None:
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.strategy = strategy
        self.release_grace_s = release_grace_s
        self._transfers: dict[str, ExpectedTransfer] = {}
        self._holder_of_block: dict[int, str] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._events: list[TransferEvent] = []
        self._notices: list[tuple[bytes, Any]] = []

    def take_actions(self) -> tuple[list[TransferEvent], list[tuple[bytes, Any]]]:
        events, notices = self._events, self._notices
        self._events, self._notices = [], []
        return events, notices

    def held_block_count(self) -> int:
        return len(self._holder_of_block)

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        now: float,
        budget_s: float | None = None,
    ) -> None:
        """`deadline` ends the transfer; with `budget_s` it ends only the wait for the grant,
        the grant sets the deadline to its time plus `budget_s`, and each accepted write to its
        time plus the larger of `budget_s` and PACE_FACTOR times its `pace_s`."""
        if not 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
            raise ValueError(f"a transfer id has 1-{MAX_TRANSFER_ID_CHARS} characters")
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        if not block_ids:
            raise ValueError(f"transfer {transfer_id!r} expects no block")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"transfer {transfer_id!r} lists a destination block twice")
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"block id {block_id} of transfer {transfer_id!r} is outside "
                    f"0..{self.num_blocks - 1}"
                )
            holder = self._holder_of_block.get(block_id)
            if holder is not None:
                raise ValueError(
                    f"block {block_id} of transfer {transfer_id!r} is still held by transfer "
                    f"{holder!r}"
                )
        all_layers = (1 << self.num_layers) - 1
        self._transfers[transfer_id] = ExpectedTransfer(
            transfer_id=transfer_id,
            block_ids=tuple(block_ids),
            deadline=deadline,
            budget_s=max(deadline - now, 0.0) if budget_s is None else budget_s,
            missing_layers={block_id: all_layers for block_id in block_ids},
            num_missing=len(block_ids) * self.num_layers,
            paced_by_writes=budget_s is not None,
        )
        self._recent.pop(transfer_id, None)
        for block_id in block_ids:
            self._holder_of_block[block_id] = transfer_id

    def grant(self, transfer_id: str, writer: bytes, now: float) -> ExpectedTransfer | str:
        """The transfer to grant, or why not. The first grant of a transfer expected with a
        budget starts its clock: the deadline becomes `now` plus the budget."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.error is not None:
            return f"transfer {transfer_id!r} is {self._describe_absent(transfer_id)}"
        if transfer.writer not in (None, writer):
            return f"transfer {transfer_id!r} is granted to another sender"
        if transfer.writer is None and transfer.paced_by_writes:
            transfer.deadline = now + transfer.budget_s
            transfer.stall_bound_s = transfer.budget_s
        transfer.writer = writer
        return transfer

    def check_write(
        self,
        transfer_id: str,
        writer: bytes,
        block_ids: list[int],
        layer_start: int,
        layer_end: int,
    ) -> str | None:
        """None when the write may land; otherwise why it must be dropped."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.error is not None:
            return f"transfer {transfer_id!r} is {self._describe_absent(transfer_id)}"
        if transfer.writer != writer:
            return f"transfer {transfer_id!r} was not granted to this sender"
        if not 0 <= layer_start < layer_end <= self.num_layers:
            return f"layer range {layer_start}..{layer_end} is outside 0..{self.num_layers}"
        if not block_ids or len(set(block_ids)) != len(block_ids):
            return "the write lists no block or a block twice"
        outside = [b for b in block_ids if b not in transfer.block_set]
        if outside:
            return f"blocks {outside[:8]} are not destination blocks of {transfer_id!r}"
        return None

    def record_write(
        self,
        transfer_id: str,
        block_ids: list[int],
        layer_start: int,
        layer_end: int,
        now: float,
        pace_s: float = 0.0,
    ) -> float:
        """Marks an accepted write as arrived (check_write returned None for it); returns the
        seconds left before the transfer's deadline (0.0 once it is complete)."""
        transfer = self._transfers[transfer_id]
        if transfer.paced_by_writes:
            transfer.stall_bound_s = max(transfer.budget_s, PACE_FACTOR * pace_s)
            transfer.deadline = max(transfer.deadline, now + transfer.stall_bound_s)
        layer_mask = ((1 << layer_end) - 1) ^ ((1 << layer_start) - 1)
        for block_id in block_ids:
            missing = transfer.missing_layers.get(block_id, 0)
            arrived_now = missing & layer_mask
            if arrived_now:
                transfer.num_missing -= arrived_now.bit_count()
                transfer.missing_layers[block_id] = missing & ~layer_mask
        if transfer.num_missing == 0:
            self._forget(transfer, "complete")
            self._events.append(
                TransferEvent(transfer_id, TransferKind.COMPLETE, block_ids=transfer.block_ids)
            )
            if transfer.writer is not None:
                self._notices.append((transfer.writer, Committed(transfer_id)))
            return 0.0
        return max(transfer.deadline - now, 0.0)

    def fail(self, transfer_id: str, error: str) -> bool:
        """Fails an expected transfer; False when it is not expected (unknown or finished)."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.error is not None:
            return False
        transfer.error = error
        self._events.append(TransferEvent(transfer_id, TransferKind.FAILED, error))
        if transfer.writer is not None:
            self._notices.append((transfer.writer, Cancel(transfer_id, error)))
            transfer.release_at = self.strategy.release_after_failure(
                transfer.deadline, self.release_grace_s
            )
        if transfer.release_at is None:
            self._release(transfer)
        return True

    def abandoned(self, transfer_id: str, writer: bytes, reason: str) -> None:
        """The granted sender will never write this transfer again."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.writer != writer:
            return
        if transfer.error is None:
            transfer.error = f"the prefill node abandoned the transfer: {reason}"
            self._events.append(TransferEvent(transfer_id, TransferKind.FAILED, transfer.error))
        self._release(transfer)

    def expire(self, now: float) -> None:
        for transfer in list(self._transfers.values()):
            if transfer.error is None and now >= transfer.deadline:
                self.fail(transfer.transfer_id, self._missed_deadline(transfer))
            elif transfer.release_at is not None and now >= transfer.release_at:
                self._release(transfer)

    def _missed_deadline(self, transfer: ExpectedTransfer) -> str:
        if transfer.writer is None and transfer.paced_by_writes:
            return (
                f"the prefill node did not start the KV transfer for request "
                f"{transfer.transfer_id!r} before its deadline (the prompt waited in its queue)"
            )
        total = len(transfer.block_ids) * self.num_layers
        arrived = f"{total - transfer.num_missing} of {total} block-layers arrived"
        if transfer.paced_by_writes:
            return (
                f"KV transfer for request {transfer.transfer_id!r} made no progress for "
                f"{transfer.stall_bound_s:.2f} s ({arrived})"
            )
        return (
            f"KV transfer for request {transfer.transfer_id!r} did not complete within its "
            f"{transfer.budget_s:.2f} s deadline ({arrived})"
        )

    def next_timer(self) -> float | None:
        """The earliest deadline or release time still ahead."""
        times = [
            t.release_at if t.error is not None else t.deadline for t in self._transfers.values()
        ]
        return min((t for t in times if t is not None), default=None)

    def _release(self, transfer: ExpectedTransfer) -> None:
        self._forget(transfer, "released")
        self._events.append(
            TransferEvent(
                transfer.transfer_id, TransferKind.RELEASED, transfer.error, transfer.block_ids
            )
        )

    def _forget(self, transfer: ExpectedTransfer, outcome: str) -> None:
        del self._transfers[transfer.transfer_id]
        for block_id in transfer.block_ids:
            del self._holder_of_block[block_id]
        self._recent[transfer.transfer_id] = outcome
        while len(self._recent) > RECENT_TRANSFERS_REMEMBERED:
            self._recent.popitem(last=False)

    def committed(self, transfer_id: str) -> bool:
        """Whether the transfer completed (as far as the ledger remembers)."""
        return transfer_id not in self._transfers and self._recent.get(transfer_id) == "complete"

    def _describe_absent(self, transfer_id: str) -> str:
        """A failed transfer's state with its reason: a write that crosses the decode node's
        abort is refused for that reason, whichever reaches the sender first."""
        transfer = self._transfers.get(transfer_id)
        if transfer is not None:
            return f"failed: {transfer.error}" if transfer.error else "failed"
        return self._recent.get(transfer_id, "unknown")
