"""`NodeConfig`: everything a node process is told besides its engine settings, checked once.

Every role takes it (keyword-only, beside its engine): the addresses it binds, advertises and
sends to, its heartbeat, its cluster secret; the KV fields matter to the roles that move KV
(prefill: `kv_transport`; decode: all of them) and are ignored by the colocated node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from node.heartbeat import DEFAULT_STALL_LIMIT_S
from wire.cluster_auth import ClusterAuth


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    listen_address: str
    router_address: str
    advertise_address: str | None = None  # where others reach listen_address (default: it)
    heartbeat_interval: float = 0.5
    stall_limit_s: float = DEFAULT_STALL_LIMIT_S  # no progress this long: heartbeats stop
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth.none)
    kv_transport: str = "shm"
    kv_listen_address: str = "tcp://127.0.0.1:0"  # the decode node's KV channel
    transfer_timeout_s: float = 30.0  # a KV transfer, from its first write; then first token
    queue_timeout_s: float = 120.0  # the wait for KV blocks, then for the prefill to start

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "stall_limit_s", "transfer_timeout_s", "queue_timeout_s"):
            seconds = getattr(self, name)
            if not (isinstance(seconds, (int, float)) and 0 < seconds and math.isfinite(seconds)):
                raise ValueError(f"{name} is {seconds!r} s; expected a positive, finite time")
        if not self.node_id:
            raise ValueError("node_id must not be empty")

    @property
    def reachable_address(self) -> str:
        """The address the router and peers send to."""
        return self.advertise_address or self.listen_address
