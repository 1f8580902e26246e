"""What every node's command line shares: engine flags, node addresses, signals, logging.

`python -m pdserve.node ROLE` (node/__main__.py) builds its parser with `role_parser` (every
node's flags from `node_parser`, plus `add_kv_flags` for the roles that move KV), then calls
`run_node(args, role)`: logging set up from LogSettings (`--log-level`, `--log-format
text|json`; wire/log_format.py), SIGTERM and SIGINT handlers installed before the (slow) model
load, then `role(engine_config=..., config=...)` makes the node and `run()` serves until a
signal; the exit status is 0, or 2 for invalid settings. The cluster secret (`--cluster-secret`,
else `PDSERVE_CLUSTER_SECRET`) is read here, once; without one every address the node binds,
advertises or dials must be a loopback one.

Every flag is generated from EngineConfig's, NodeConfig's and LogSettings' fields
(wire/config_flags.py). `pdserve serve` hands its nodes their settings as data: JSON in
`PDSERVE_NODE_CONFIG`, {"engine": {field: value}, "node": {...}, "log": {...}}, in field units
(swap_space in bytes); flags given on the command line override it.

Device: a node runs on `--device` (default: the first GPU it sees, else the CPU), made the
process's current CUDA device before the model loads. `pdserve serve` lists the node's own GPU
first in its CUDA_VISIBLE_DEVICES (commands/launcher.py), so the default is the right one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.kvtransfer import TRANSPORT_NAMES
from pdserve.kvtransfer.transports.mooncake_engine import mooncake_missing
from pdserve.node.config import CONFIG_ENV, NodeConfig
from pdserve.wire.cluster_auth import SECRET_ENV, ClusterAuth
from pdserve.wire.config_flags import add_flags, build
from pdserve.wire.log_format import LogSettings
from pdserve.wire.roles import KV_ROLES, Role

CONFIG_PARTS = {"engine": EngineConfig, "node": NodeConfig, "log": LogSettings}


def _for_every_role(f: dataclasses.Field) -> bool:
    return f.metadata.get("roles") is None


def node_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description,
        epilog=f"${CONFIG_ENV} (JSON, from `pdserve serve`) gives settings these flags override.",
    )
    add_flags(parser, EngineConfig)
    add_flags(parser, NodeConfig, select=_for_every_role)
    add_flags(parser, LogSettings, select=_for_every_role)
    parser.add_argument(
        "--cluster-secret", default=os.environ.get(SECRET_ENV) or None, metavar="SECRET",
        help=f"shared by the router and every node (default: ${SECRET_ENV}); needed for "
        "any address that is not a loopback one",
    )
    return parser


def add_kv_flags(parser: argparse.ArgumentParser, *, receiver: bool) -> None:
    """The KV transfer flags: the transport (both ends), and the receiving end's channel
    address and deadlines (decode nodes)."""
    role = Role.DECODE if receiver else Role.PREFILL
    add_flags(parser, NodeConfig, select=lambda f: role in (f.metadata.get("roles") or ()))


def role_parser(role: Role, description: str = "") -> argparse.ArgumentParser:
    """The parser of `python -m pdserve.node ROLE`: every node's flags, plus the KV flags of
    the roles that move KV."""
    parser = node_parser(f"python -m pdserve.node {role}", description)
    if role in KV_ROLES:
        add_kv_flags(parser, receiver=role is Role.DECODE)
    return parser


def launcher_config(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The settings `pdserve serve` handed this node as data ({} parts when none)."""
    text = environ.get(CONFIG_ENV)
    loaded = json.loads(text) if text else {}
    well_formed = isinstance(loaded, dict) and set(loaded) <= set(CONFIG_PARTS)
    if not well_formed or not all(isinstance(part, dict) for part in loaded.values()):
        raise ValueError(
            f"${CONFIG_ENV} must be a JSON object of objects, keys among {sorted(CONFIG_PARTS)}"
        )
    return {part: loaded.get(part, {}) for part in CONFIG_PARTS}


def node_config(
    args: argparse.Namespace, auth: ClusterAuth, base: Mapping[str, Any] | None = None
) -> NodeConfig:
    """ValueError for settings out of range, or a required address missing."""
    config = build(NodeConfig, args, base, cluster_auth=auth)
    if config.kv_transport not in TRANSPORT_NAMES:
        raise ValueError(
            f"kv_transport {config.kv_transport!r} is unknown; valid: {', '.join(TRANSPORT_NAMES)}"
        )
    if config.kv_transport == "mooncake" and (missing := mooncake_missing()) is not None:
        raise ValueError(f"--kv-transport mooncake: {missing}")
    auth.check_addresses(
        [
            ("--listen", config.listen_address),
            ("--advertise", config.advertise_address),
            ("--router", config.router_address),
            ("--kv-listen", config.kv_listen_address),
        ]
    )
    return config


def engine_config(args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> EngineConfig:
    return build(EngineConfig, args, base)


def configs(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[EngineConfig, NodeConfig, LogSettings]:
    """What a node builds: `environ`'s launcher config, then the flags given. ValueError for
    invalid settings (a bad secret, addresses a missing secret cannot cover, values out of
    range)."""
    parts = launcher_config(environ)
    auth = ClusterAuth.from_secret(args.cluster_secret)
    return (
        engine_config(args, parts["engine"]),
        node_config(args, auth, parts["node"]),
        build(LogSettings, args, parts["log"]),
    )


def use_device(device: torch.device) -> None:
    """Makes a node's CUDA device the process's current one, so kernels, streams and events
    that take the current device (Triton launches, CUDA graphs) land on it."""
    if device.type != "cuda" or device.index is None:
        return
    if not 0 <= device.index < torch.cuda.device_count():
        raise ValueError(
            f"device {device} is not visible: this process sees "
            f"{torch.cuda.device_count()} CUDA device(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    torch.cuda.set_device(device)


def run_node(args: argparse.Namespace, role: Callable[..., Any]) -> int:
    """Runs the node `role(engine_config=..., config=...)` builds until a signal."""
    logger = logging.getLogger("pdserve.node")
    signals: list[int] = []
    node = None

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        if node is not None:
            node.stop()

    # Installed before the (slow) model load so an early SIGTERM still exits cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        engine, config, log = configs(args, os.environ)
    except ValueError as error:
        LogSettings().apply()
        logger.error("invalid settings: %s", error)
        return 2
    log.apply()
    try:
        use_device(engine.resolve_device())
    except ValueError as error:
        logger.error("invalid settings: %s", error)
        return 2
    logger.info("loading model %s", engine.model or "(default)")
    node = role(engine_config=engine, config=config)
    if signals:  # before it served: node.run() would have logged its own "stopped" line
        logger.info("stopped on %s while loading", signal.Signals(signals[0]).name)
    else:
        node.run()
    return 0
