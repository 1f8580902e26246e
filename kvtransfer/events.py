"""Where an I/O thread leaves transfer events for the owning node to poll or wait on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from pdserve.kvtransfer.base import KVTransferError, TransferEvent, TransferKind


class EventBoard:
    """Thread-safe queue of events; `wait` takes one transfer's events out of it."""

    def __init__(self, terminal_kinds: Iterable[TransferKind]) -> None:
        self._terminal_kinds = frozenset(terminal_kinds)
        self._events: list[TransferEvent] = []
        self._changed = threading.Condition()

    def post(self, events: Iterable[TransferEvent]) -> None:
        events = list(events)
        if not events:
            return
        with self._changed:
            self._events.extend(events)
            self._changed.notify_all()

    def take_all(self) -> list[TransferEvent]:
        with self._changed:
            events, self._events = self._events, []
        return events

    def wait(self, transfer_id: str, timeout: float) -> TransferEvent:
        """The transfer's terminal event, carrying the error of an earlier FAILED event."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                mine = [e for e in self._events if e.transfer_id == transfer_id]
                terminal = next((e for e in mine if e.kind in self._terminal_kinds), None)
                if terminal is not None:
                    self._events = [e for e in self._events if e.transfer_id != transfer_id]
                    error = terminal.error or next((e.error for e in mine if e.error), None)
                    return TransferEvent(transfer_id, terminal.kind, error, terminal.block_ids)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise KVTransferError(
                        f"KV transfer for request {transfer_id!r} did not finish within the "
                        f"{timeout:.2f} s wait"
                    )
                self._changed.wait(remaining)
