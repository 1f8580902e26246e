"""Router settings: one dataclass, built by the CLI or directly by tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from router.node_registry import parse_node_spec
from wire.cluster_auth import ClusterAuth
from wire.limits import MAX_CHOICES_PER_PROMPT


@dataclass
class RouterConfig:
    """Everything the router needs to know; no other configuration exists.

    `node_addresses` are the nodes' PULL addresses (`tcp://host:port`), optionally prefixed
    with the node's id (`ID=tcp://host:port`) so NodeStats can be matched to an address when
    several nodes are configured. `listen_address` is where the router binds its PULL socket.
    `cluster_auth` (wire/cluster_auth.py) secures every ZeroMQ link to the nodes; without a
    secret the listen and node addresses must be loopback ones.
    """

    model_path: str | Path
    served_model_name: str | None = None
    # Further names requests may send as `model` (`--served-model-name A B`: B); /v1/models
    # lists `model_name` alone, as vLLM does.
    served_model_aliases: tuple[str, ...] = ()
    # The chat template's source, replacing the model folder's (`--chat-template`).
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    node_addresses: list[str] = field(default_factory=list)
    listen_address: str = "tcp://127.0.0.1:5600"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    # Completions with a list of prompts: prompts x n per request (router/prompts.py).
    max_choices: int = 64
    max_stop: int = 4
    # Admission: sub-requests (n per request) accepted and not yet started (no token back),
    # and their prompt tokens; past either bound the router answers 429 (router/admission.py).
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    # A request whose prefill would start later than this is refused (429) at once: the node
    # that would compute its prompt has more queued prompt tokens than it prefills in this
    # time (its measured speed), or a request waiting there is already this old
    # (router/queue_delay.py).
    max_queue_delay_s: float = 30.0
    # Streaming: a write to the client blocked this long aborts the request; at most this many
    # tokens wait in the router for a client that reads slower than the node generates.
    stream_stall_timeout_s: float = 30.0
    max_stream_buffer_tokens: int = 8192
    # A node is dead after this long without a heartbeat. Nodes send one every 0.5 s from a
    # thread of their own, so `python -m router` and `pdserve serve` use 1.0 s (two missed
    # heartbeats); this lenient default suits embedders whose nodes report less often.
    node_timeout_s: float = 30.0
    # On SIGTERM, requests in flight get this long to finish (router/drain.py).
    drain_timeout_s: float = 30.0
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth.none)
    # Logs: one INFO line per request (router/access_log.py), and every
    # `stats_log_interval_s` one per node that had traffic (router/stats_log.py).
    log_requests: bool = True
    log_stats: bool = True
    stats_log_interval_s: float = 5.0

    def __post_init__(self) -> None:
        nodes = [("--node", parse_node_spec(spec)[1]) for spec in self.node_addresses]
        self.cluster_auth.check_addresses([("--listen", self.listen_address), *nodes])
        for name in (
            "max_queued_requests", "max_queued_tokens", "max_stream_buffer_tokens", "max_choices"
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; expected an integer >= 1")
        if not 1 <= self.max_n <= MAX_CHOICES_PER_PROMPT:
            raise ValueError(f"max_n is {self.max_n!r}; expected 1 to {MAX_CHOICES_PER_PROMPT}")
        if not 0 < self.max_queue_delay_s <= 3600:
            raise ValueError(
                f"max_queue_delay_s is {self.max_queue_delay_s}; expected (0, 3600] s"
            )
        if not 0 < self.stats_log_interval_s <= 3600:
            raise ValueError(
                f"stats_log_interval_s is {self.stats_log_interval_s}; expected (0, 3600] s"
            )
        if not 0 < self.stream_stall_timeout_s <= 3600:
            raise ValueError(
                f"stream_stall_timeout_s is {self.stream_stall_timeout_s}; expected (0, 3600] s"
            )

    @property
    def model_name(self) -> str:
        """The name clients must send as `model` (defaults to the model path as given)."""
        return self.served_model_name or str(self.model_path)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may send as `model`: `model_name` and the aliases."""
        return (self.model_name, *self.served_model_aliases)
