"""What a KV sender's I/O thread tracks: its configuration, each transfer it is writing, each
queued write, and each message not yet acknowledged (see kvtransfer/sender.py for the flow)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kvtransfer.transports.base import WriteStep
from pdserve.wire.cluster_auth import ClusterAuth


@dataclass(frozen=True)
class SenderConfig:
    """`io_thread_niceness` is added to the sender I/O thread's nice value (Linux; 0 leaves it).
    On a CPU prefill node the forward's OpenMP workers keep every core busy for a while after
    each parallel region, and at equal priority the scheduler ran the just-woken I/O thread and
    the decode process first: `write` then returned only after the whole chunk was copied
    (2.5 ms a chunk on this project's 2-core machine). At +10 it returns in 0.1 ms and the copy
    runs behind the next chunk's forward. With a cluster secret (`cluster_auth`) the channel's
    DEALER is a CURVE client: it reaches only a decode node that holds the secret."""

    grant_timeout_s: float = 30.0  # a round trip; a busy host answers late, not never
    max_inflight_bytes: int = 64 << 20
    step_bytes: int = 4 << 20
    io_thread_niceness: int = 10
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth.none)

    def __post_init__(self) -> None:
        if not 0 <= self.io_thread_niceness <= 19:
            raise ValueError(f"io_thread_niceness is {self.io_thread_niceness}; expected 0-19")
        if not 0 < self.grant_timeout_s <= 600:
            raise ValueError(f"grant_timeout_s is {self.grant_timeout_s}; expected (0, 600] s")
        if not (1 << 16) <= self.step_bytes <= self.max_inflight_bytes:
            raise ValueError(
                f"step_bytes is {self.step_bytes:,}; expected 64 KiB..max_inflight_bytes "
                f"({self.max_inflight_bytes:,})"
            )


@dataclass
class WriteJob:
    """One `write`: its blocks and layer range, the transport's readiness token, and how long
    the prefill step that filled them took (`pace_s`, sent with its messages)."""

    src_block_ids: list[int]
    dst_block_ids: list[int]
    layers: range
    ready: object | None
    pace_s: float = 0.0
    steps: deque[WriteStep] | None = None

    @property
    def layer_mask(self) -> int:
        return ((1 << self.layers.stop) - 1) ^ ((1 << self.layers.start) - 1)


@dataclass
class OutgoingTransfer:
    """`deadline` is the grant wait limit until Grant arrives, then the time Begin was sent
    plus the seconds the decode node granted, then moved by each Ack to the time its write
    was sent plus the seconds left it names: a message is sent before it arrives, so this is
    never later than the decode node's deadline."""

    transfer_id: str
    begin_sent_at: float
    deadline: float
    jobs: deque[WriteJob] = field(default_factory=deque)
    granted_blocks: frozenset[int] | None = None
    written_layers: dict[int, int] = field(default_factory=dict)  # block -> layer bit mask
    unacked: set[int] = field(default_factory=set)


@dataclass
class InFlight:
    """A Data or Written message sent and not yet acknowledged (a Written has no bytes in
    the window: its copies already landed)."""

    transfer_id: str
    nbytes: int
    on_ack: Callable[[], None] | None
    sent_at: float
