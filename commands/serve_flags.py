"""The flags of `pdserve serve` (and the engine flags `pdserve generate` and `pdserve chat` share).

The engine's, the nodes', the router's and the logging options are generated from EngineConfig,
NodeConfig, RouterConfig and LogSettings (wire/config_flags.py), but for those the launcher
decides itself (`launcher_sets`); the launcher's own are generated from LauncherSettings
(commands/launcher_settings.py), but for MODEL (positional) and `--cluster-secret` (from the
environment, else made per run), written here.

Where a flag means what vLLM's flag of the same name means, it has vLLM's spelling (the table in
docs/operations.md maps each to vLLM's and SGLang's). `check_serve_flags` checks them once,
before the launcher resolves the model or starts any process; a ValueError from it is printed
with `pdserve serve`'s usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from pdserve.commands.launcher_settings import LauncherSettings
from pdserve.commands.planner_settings import PlannerSettings
from pdserve.commands.vllm_flags import add_vllm_flags
from pdserve.wire.cluster_auth import SECRET_ENV
from pdserve.wire.config_flags import add_flags, given, in_flag_terms
from pdserve.wire.log_format import LogSettings


def _not_launcher_set(f: dataclasses.Field) -> bool:
    return not f.metadata.get("launcher_sets")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """`pdserve generate` and `pdserve chat`: every EngineConfig option, and sampling."""
    from pdserve.engine.config import EngineConfig

    add_flags(parser, EngineConfig)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)


def _node_option_flags(serve: argparse.ArgumentParser) -> None:
    """Every EngineConfig and NodeConfig option the launcher does not decide itself, generated
    from the dataclasses; the launcher hands each node the values given (commands/launcher.py)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.node.config import NodeConfig

    add_flags(
        serve.add_argument_group("engine (each node's EngineConfig)"), EngineConfig,
        select=_not_launcher_set,
    )
    add_flags(
        serve.add_argument_group("node (each node's NodeConfig)"), NodeConfig,
        select=_not_launcher_set,
    )
    add_flags(serve.add_argument_group("logging (the router's and every node's)"), LogSettings)


def _router_option_flags(serve: argparse.ArgumentParser) -> None:
    """Every RouterConfig option the launcher does not decide itself, generated from the
    dataclass; the launcher hands the router the values given (commands/router_plan.py)."""
    from pdserve.router.config import RouterConfig

    add_flags(
        serve.add_argument_group("router (the router's RouterConfig)"), RouterConfig,
        select=_not_launcher_set,
    )


def _launcher_flags(group: argparse._ArgumentGroup, name: str) -> None:
    """LauncherSettings' options of group `name`, with their defaults (nothing is layered
    under them): the launcher reads them from its arguments."""
    add_flags(
        group, LauncherSettings, select=lambda f: f.metadata.get("group") == name, defaults=True
    )


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    _launcher_flags(serve.add_argument_group("deployment (LauncherSettings)"), "deployment")
    model = serve.add_argument_group("model (LauncherSettings)")
    model.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a model folder or a Hugging Face Hub id (org/name); default: SmolLM2-135M-Instruct",
    )
    _launcher_flags(model, "model")
    add_flags(
        serve.add_argument_group("run-time planner (PlannerSettings)"), PlannerSettings,
        defaults=True,
    )
    _node_option_flags(serve)
    _router_option_flags(serve)
    serve.add_argument(
        "--cluster-secret",
        default=os.environ.get(SECRET_ENV) or None,
        metavar="SECRET",
        help=f"secures the ZeroMQ links between router and nodes (default: ${SECRET_ENV}, "
        "else a random one for this run's own processes)",
    )
    add_vllm_flags(serve)  # last: every vLLM spelling not given above (commands/vllm_flags.py)


def check_serve_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first flag out of range; sets `args.model` from MODEL."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(f"MODEL {args.model_arg!r} and --model {args.model!r} differ; give one")
    args.model = args.model_arg if args.model_arg is not None else args.model
    LauncherSettings(**given(LauncherSettings, args))
    check_planner_flags(args)


def check_planner_flags(args: argparse.Namespace) -> None:
    """ValueError for a planner option out of range, or a deployment it could not act on."""
    from pdserve.commands.router_admin import admin_url

    try:
        planner = PlannerSettings(**given(PlannerSettings, args))
    except ValueError as error:
        raise ValueError(in_flag_terms(PlannerSettings, str(error))) from None
    if not planner.enabled:
        return
    if args.colocated:
        raise ValueError(
            f"--planner {planner.planner} turns prefill and decode nodes into each other; a "
            "--colocated deployment has neither"
        )
    if args.prefill + args.decode < 3:
        raise ValueError(
            f"--planner {planner.planner} keeps one prefill and one decode node serving, so "
            f"with --prefill {args.prefill} --decode {args.decode} it could never act: give "
            "three nodes or more"
        )
    admin_url(args.host, args.port)
