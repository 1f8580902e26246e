"""`NodeConfig`: everything a node process is told besides its engine settings, checked once.

Every role takes it (keyword-only, beside its engine): the addresses it binds, advertises and
sends to, its heartbeat, its cluster secret; the KV fields matter to the roles that move KV
(prefill: `kv_transport`; decode: all of them) and are ignored by the colocated node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.node.heartbeat import DEFAULT_STALL_LIMIT_S
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.config_flags import option
from pdserve.wire.roles import KV_ROLES, Role

# `pdserve serve` hands each node its settings as JSON here (node/cli.py).
CONFIG_ENV = "PDSERVE_NODE_CONFIG"
KV_SENDERS = KV_ROLES  # the roles whose nodes move KV (`roles` of an option)


@dataclass(frozen=True)
class NodeConfig:
    """Each field's `option` metadata gives its flag and help (wire/config_flags.py); fields
    without one (the stall limit, the cluster secret's keys) are set by code."""

    node_id: str = option(
        flag="--node-id", launcher_sets=True,
        help="the node's name; shared-memory segments are named after it (required)",
    )
    listen_address: str = option(
        flag="--listen", launcher_sets=True, metavar="ADDR",
        help="the ZeroMQ address to bind, e.g. tcp://HOST:PORT; port 0: one the OS picks, "
        "which the node reports to the router (required)",
    )
    router_address: str = option(
        flag="--router", launcher_sets=True, metavar="ADDR",
        help="the router's PULL address (required)",
    )
    advertise_address: str | None = option(
        None, flag="--advertise", launcher_sets=True, metavar="ADDR",
        help="the address others reach --listen at (default: --listen)",
    )
    heartbeat_interval: float = option(
        0.5, flag="--heartbeat-interval", metavar="SECONDS",
        help="how often each node tells the router it is alive",
    )
    stall_limit_s: float = DEFAULT_STALL_LIMIT_S  # no progress this long: heartbeats stop
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth.none)
    kv_transport: str = option(
        "shm", flag="--kv-transport", launcher_sets=True, roles=KV_SENDERS,
        help="how KV moves between prefill and decode nodes: shm, zmq, cuda_ipc or mooncake",
    )
    kv_layers_per_write: int | None = option(
        None, flag="--kv-layers-per-write", roles=(Role.PREFILL,), metavar="N",
        help="a prefill node writes each chunk's KV in groups of N layers, each as soon as the "
        "forward has computed it, so the copy overlaps the later layers (default: a quarter of "
        "the model's layers, rounded up, on a GPU; one write after the forward on a CPU, where "
        "the copy would take the forward's cores; the model's layer count or more: one write "
        "after the forward; tensor-parallel prefill always writes after the forward)",
    )
    kv_listen_address: str = option(
        "tcp://127.0.0.1:0", flag="--kv-listen", launcher_sets=True, roles=(Role.DECODE,),
        metavar="ADDR", help="the decode node's KV channel bind address",
    )
    transfer_timeout_s: float = option(
        30.0, flag="--transfer-timeout", roles=(Role.DECODE,), metavar="SECONDS",
        help="how long a KV transfer may go without a write landing (from its grant, then "
        "from each write; at least 3x the forward that filled the last write), and the "
        "deadline of the first token after the KV arrived",
    )
    queue_timeout_s: float = option(
        120.0, flag="--queue-timeout", roles=(Role.DECODE,), metavar="SECONDS",
        help="how long a request may wait on a decode node for free KV blocks, then for its "
        "prefill node to start on it",
    )
    threads_while_prefill_idle: int | None = option(
        None, flag="--threads-while-prefill-idle", launcher_sets=True, roles=(Role.DECODE,),
        metavar="N",
        help="CPU threads of the decode node while none of its prompts is being prefilled, "
        "its --num-threads while one is (decode_node/borrowed_threads.py; default: "
        "--num-threads throughout)",
    )

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "stall_limit_s", "transfer_timeout_s", "queue_timeout_s"):
            seconds = getattr(self, name)
            if not (isinstance(seconds, (int, float)) and 0 < seconds and math.isfinite(seconds)):
                raise ValueError(f"{name} is {seconds!r} s; expected a positive, finite time")
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        layers = self.kv_layers_per_write
        if layers is not None and (
            not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= 4096
        ):
            raise ValueError(f"kv_layers_per_write is {layers!r}; expected 1-4096 layers")
        threads = self.threads_while_prefill_idle
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads_while_prefill_idle is {threads!r}; expected 1 or more")

    @property
    def reachable_address(self) -> str:
        """The address the router and peers send to."""
        return self.advertise_address or self.listen_address
