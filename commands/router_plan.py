"""The router `pdserve serve` starts: its RouterConfig, planned from serve's flags, handed as data.

`pdserve serve` takes every RouterConfig option the launcher does not decide itself, generated
from the dataclass (commands/serve_flags.py). The launcher decides the rest: the model folder,
the tokenizer's (`--tokenizer`) and the served names (as it resolved them), `--host`/`--port`, the router's ZeroMQ address, the
nodes it started and the cluster secret.

The router process's argv is `python -m pdserve.router` alone. Its settings travel as data: JSON in
$PDSERVE_ROUTER_CONFIG (router/config.py's CONFIG_ENV), {"router": {field: value}, "log":
{field: value}}, in field units (the chat template's text, not its file's name). Secrets (the
options with an `env` variable: the API key; and the cluster secret) travel in their own
environment variables, never on the command line (which `ps` shows every user) nor in that
JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.commands.model_source import ServedModel
from pdserve.router.config import CONFIG_ENV, RouterConfig
from pdserve.wire.child_command import python_module_command
from pdserve.wire.cluster_auth import SECRET_ENV, ClusterAuth
from pdserve.wire.config_flags import build, given, given_as_environment, in_flag_terms
from pdserve.wire.log_format import LogSettings


def serve_option(f: dataclasses.Field) -> bool:
    """A RouterConfig option `pdserve serve` takes as a flag (the launcher decides the rest)."""
    return not f.metadata.get("launcher_sets")


def _handed_as_data(f: dataclasses.Field) -> bool:
    return serve_option(f) and "env" not in f.metadata


def router_options(args: argparse.Namespace) -> dict[str, Any]:
    """The RouterConfig options given to `pdserve serve` that travel as data, as field values
    (secrets left out)."""
    return given(RouterConfig, args, select=_handed_as_data)


def check_router_settings(args: argparse.Namespace) -> None:
    """ValueError, in flag terms, for a router option out of range or a chat template that is
    neither a file nor a template that parses: checked by RouterConfig itself, before the
    model is resolved or any process starts."""
    try:
        RouterConfig(model_path="-", **given(RouterConfig, args, select=serve_option))
    except ValueError as error:
        raise ValueError(in_flag_terms(RouterConfig, str(error))) from None


@dataclass
class RouterPlan:
    """The router process: `argv`, and `env` carrying its settings; `config` is the
    RouterConfig it will build from them (the launcher reads its drain timeout)."""

    argv: list[str]
    env: dict[str, str]
    config: RouterConfig


def plan_router(
    args: argparse.Namespace,
    served: ServedModel,
    listen_address: str,
    node_addresses: Sequence[str],
    cluster_secret: str,
) -> RouterPlan:
    """The router of a deployment whose nodes are `node_addresses` (`ID=tcp://...`)."""
    values = router_options(args)
    values.update(
        model_path=str(served.folder),
        tokenizer_path=str(served.tokenizer_folder) if served.tokenizer_folder else None,
        served_model_name=served.names[0],
        served_model_aliases=list(served.names[1:]),
        host=args.host,
        port=args.port,
        listen_address=listen_address,
        node_addresses=list(node_addresses),
    )
    env = {
        CONFIG_ENV: json.dumps({"router": values, "log": given(LogSettings, args)}),
        SECRET_ENV: cluster_secret,
        **given_as_environment(RouterConfig, args, select=serve_option),
    }
    config = build(RouterConfig, base=values, cluster_auth=ClusterAuth.from_secret(cluster_secret))
    return RouterPlan(python_module_command("pdserve.router"), env, config)
