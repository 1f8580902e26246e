"""Who puts a transfer's bytes into the decode node's blocks: the two write strategies.

Each transport names its strategy once (`ReceiverTransport.strategy`, `SenderTransport.strategy`
in kvtransfer/transports/base.py); the sender, the receiver and the ledger ask the strategy what
to do and never which transport they run.

DirectWrite (shm, cuda_ipc, mooncake, inprocess): the sender copies each step straight into the
  decode node's buffer, which it has mapped (or registered with Mooncake), and reports each
  finished write with one Written message. No byte crosses the channel, so the window never
  fills; each Written is acknowledged (Ack) only to move the sender's deadline.
Streamed (zmq): the sender packs each step into a Data message; the receiver's I/O thread checks
  it against the ledger, scatters it into the blocks and acknowledges it (Ack, which also
  moves the sender's deadline); unacknowledged bytes are bounded by the sender's window
  (SenderConfig.max_inflight_bytes).

Who calls what, and when:
  step_message           the sender's I/O thread, after each step's `run_step`: the Data message
                         that carries the step, or None when its bytes have landed already.
  finish_job             the sender's I/O thread, after a write's last step: waits until the
                         copies are in the decode node's memory (`finish_write`) and returns the
                         Written message that reports them (the write's blocks over its layer
                         range), or None when Data messages did.
  write_message          the receiver's I/O thread, for each Data or Written message: the one
                         kind this strategy accepts as a write; the other kind is rejected.
  release_after_failure  the ledger, when a granted transfer fails: when its blocks may be
                         released, or None for at once (the late-write rule, kvtransfer/ledger.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pdserve.kvtransfer.messages import Data, Written

if TYPE_CHECKING:
    from pdserve.kvtransfer.transports.base import SenderTransport, WriteStep


class WriteStrategy(abc.ABC):
    write_message: ClassVar[type[Data | Written]]

    @abc.abstractmethod
    def step_message(
        self,
        transfer_id: str,
        step: WriteStep,
        dtype: str,
        next_seq: Callable[[], int],
        pace_s: float,
    ) -> Data | None: ...

    @abc.abstractmethod
    def finish_job(
        self,
        transport: SenderTransport,
        transfer_id: str,
        dst_block_ids: list[int],
        layers: range,
        ready: object | None,
        next_seq: Callable[[], int],
        pace_s: float,
    ) -> Written | None: ...

    @abc.abstractmethod
    def release_after_failure(self, deadline: float, release_grace_s: float) -> float | None: ...


@dataclass(frozen=True)
class DirectWrite(WriteStrategy):
    """The sender writes into the decode node's memory itself, so a failed transfer's blocks
    stay held until the sender abandons it or `release_grace_s` after its deadline, or
    `write_timeout_s` after it where that is longer: how long a step's copy may still be landing
    after it started (a network write's timeout; 0 for a local copy)."""

    write_message: ClassVar[type[Written]] = Written
    write_timeout_s: float = 0.0

    def step_message(
        self,
        transfer_id: str,
        step: WriteStep,
        dtype: str,
        next_seq: Callable[[], int],
        pace_s: float,
    ) -> None:
        return None

    def finish_job(
        self,
        transport: SenderTransport,
        transfer_id: str,
        dst_block_ids: list[int],
        layers: range,
        ready: object | None,
        next_seq: Callable[[], int],
        pace_s: float,
    ) -> Written:
        transport.finish_write(ready)
        return Written(
            transfer_id, next_seq(), dst_block_ids, layers.start, layers.stop, pace_s
        )

    def release_after_failure(self, deadline: float, release_grace_s: float) -> float:
        return deadline + max(release_grace_s, self.write_timeout_s)


@dataclass(frozen=True)
class Streamed(WriteStrategy):
    """The receiver writes every byte itself, after checking the ledger, so a failed transfer's
    blocks are released at once: nothing can land in them after the failure."""

    write_message: ClassVar[type[Data]] = Data

    def step_message(
        self,
        transfer_id: str,
        step: WriteStep,
        dtype: str,
        next_seq: Callable[[], int],
        pace_s: float,
    ) -> Data:
        return Data(
            transfer_id, next_seq(), step.dst_block_ids, step.layer_start, step.layer_end, dtype,
            step.nbytes, pace_s,
        )

    def finish_job(
        self,
        transport: SenderTransport,
        transfer_id: str,
        dst_block_ids: list[int],
        layers: range,
        ready: object | None,
        next_seq: Callable[[], int],
        pace_s: float,
    ) -> None:
        return None

    def release_after_failure(self, deadline: float, release_grace_s: float) -> None:
        return None
