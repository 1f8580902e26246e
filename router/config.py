"""Router settings: one dataclass, built by the CLI or directly by tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RouterConfig:
    """Everything the router needs to know; no other configuration exists.

    `node_addresses` are the nodes' PULL addresses (`tcp://host:port`), optionally prefixed
    with the node's id (`ID=tcp://host:port`) so NodeStats can be matched to an address when
    several nodes are configured. `listen_address` is where the router binds its PULL socket.
    """

    model_path: str | Path
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    node_addresses: list[str] = field(default_factory=list)
    listen_address: str = "tcp://127.0.0.1:5600"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_stop: int = 4
    max_waiting_requests: int = 1024
    # Nodes report between engine steps; a 2,048-token prefill step takes ~3 s on two CPU cores.
    node_timeout_s: float = 30.0

    @property
    def model_name(self) -> str:
        """The name clients must send as `model` (defaults to the model path as given)."""
        return self.served_model_name or str(self.model_path)
