"""`pdserve serve --ray [ADDRESS]`: the same deployment as commands/launcher.py, its processes
run as actors of a Ray cluster that places them on its hosts.

ADDRESS is a running cluster's (`ray start --head` printed it; `auto` or $RAY_ADDRESS find one
on this host); without it, `ray.init()` joins the cluster $RAY_ADDRESS names, else starts one
on this host for the run. Every host must have pdserve installed (the `ray` extra) and the model
folder at the same path (a shared filesystem, or the same download on each).

Start-up, in order:
  1. The cluster's hosts (`ray.nodes()`): their CPUs and whether any has GPUs decide each node's
     bundle and threads (commands/ray_placement.py).
  2. Every node's placement group is asked for at once, and the launcher waits until Ray has
     placed them all (at most PLACE_TIMEOUT_S: past it, one line naming what did not fit).
  3. The KV transport, from where they were placed (commands/ray_placement.py).
  4. The router's actor on this Ray node (the HTTP port is here), listening for its nodes on this
     host's address; then one actor per node, each told the router's address: nodes find the
     router through the launcher, and the router learns each node's address from its heartbeat.
     A cluster secret guards every ZeroMQ socket, as on one host (`--cluster-secret`, else a
     random one for the run); it reaches the actors as an argument, kept in Ray's control store,
     never on a command line.
  5. Ready once the router's /health answers 200; then supervised (commands/ray_replicas.py)
     and, with `--planner`, changed by the run-time planner one replica at a time
     (commands/role_changer.py), as on one host.
SIGTERM drains as on one host; every actor and placement group is released before the launcher
exits, and a cluster started for the run is stopped.

Not built: the router's actor is pinned to the launcher's host, and Ray restarts it there (its
port free again once its process is gone); GPU nodes under Ray see their own GPU alone, so KV
between them moves over zmq (or mooncake), not CUDA IPC.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
from typing import Any

from pdserve.commands.launcher import (
    READY_TIMEOUT_S,
    NodePlan,
    choose_kv_transport,
    node_settings,
    wait_healthy,
)
from pdserve.commands.model_source import check_model_folder, resolve_served_model
from pdserve.commands.operator_lines import OperatorLines
from pdserve.commands.planner_settings import PlannerSettings
from pdserve.commands.ray_placement import node_bundle, nodes_across_hosts, threads_per_node
from pdserve.commands.ray_process_actor import ray_node_address
from pdserve.commands.ray_replicas import ROUTER, RayReplicas
from pdserve.commands.router_plan import plan_router
from pdserve.commands.router_tls import router_scheme, router_tls_context
from pdserve.commands.serving_loop import planner_for, supervise
from pdserve.wire.child_command import python_module_command
from pdserve.wire.cluster_auth import SECRET_ENV
from pdserve.wire.config_flags import given
from pdserve.wire.free_ports import free_port
from pdserve.wire.roles import Role

PLACE_TIMEOUT_S = 300.0
MAX_RESTARTS = 4  # Ray's restarts of one node's actor, with --restart-nodes (the default)
# A node's listen address before its actor, on the host Ray placed it, chooses its own.
UNPLACED_ADDRESS = "tcp://0.0.0.0:0"


def ray_kv_transport(requested: str, across_hosts: bool, on_gpus: bool) -> str:
    """`auto`: as commands/ray_placement.py says; a named one as given (mooncake checked)."""
    if requested != "auto":
        return choose_kv_transport(requested)
    if on_gpus:
        return "zmq"  # nodes see their own GPU alone under Ray (module docstring)
    return choose_kv_transport("auto", across_hosts) if across_hosts else "shm"


def node_names(args: argparse.Namespace) -> list[tuple[str, Role]]:
    """(node id, role) per node, named as the launcher names them on one host."""
    roles = [Role.COLOCATED] if args.colocated else (
        [Role.PREFILL] * args.prefill + [Role.DECODE] * args.decode
    )
    counts = dict.fromkeys(Role, 0)
    named = []
    for role in roles:
        named.append((f"{role.value}-{counts[role]}.{args.port}", role))
        counts[role] += 1
    return named


def plan_ray_node(
    name: str, role: Role, settings: dict[str, dict[str, Any]], model: str, router_address: str,
    threads: int | None, kv_transport: str | None, tokenizer: str | None = None,
) -> NodePlan:
    """Node `name`'s process, as commands/launcher.py plans one; its actor sets its address."""
    from pdserve.node.config import CONFIG_ENV

    engine = {**settings["engine"], "model": model}
    if tokenizer is not None:
        engine["tokenizer"] = tokenizer
    if threads is not None:
        engine["num_threads"] = threads
    node = {**settings["node"], "router_address": router_address, "node_id": name,
            "listen_address": UNPLACED_ADDRESS}
    if kv_transport is not None:
        node["kv_transport"] = kv_transport
    config = {"engine": engine, "node": node, "log": settings["log"]}
    argv = [*python_module_command("pdserve.node"), role.value]
    return NodePlan(name, argv, UNPLACED_ADDRESS, config, {CONFIG_ENV: json.dumps(config)})


def serve_on_ray(args: argparse.Namespace) -> int:
    """Finds and checks the model, joins (or starts) the Ray cluster, serves until interrupted;
    returns the exit status."""
    import ray

    served = resolve_served_model(
        args.model, args.served_model_name, args.revision, args.download_dir, args.tokenizer
    )
    check_model_folder(served.folder, args.load_format, served.tokenizer_folder is None)
    lines = OperatorLines(args.log_format or "text")
    ray.init(address=args.ray or None, log_to_driver=bool(args.verbose), configure_logging=False)
    try:
        return _serve(args, served, lines)
    finally:
        ray.shutdown()


def _serve(args: argparse.Namespace, served: Any, lines: OperatorLines) -> int:
    import ray

    model = str(served.folder)
    alive = [node for node in ray.nodes() if node.get("Alive")]
    on_gpus = any(node["Resources"].get("GPU", 0) > 0 for node in alive)
    named = node_names(args)
    settings = node_settings(args)
    ranks = settings["engine"].get("tensor_parallel_size", 1)
    host_cpus = [node["Resources"].get("CPU", 0.0) for node in alive]
    threads = threads_per_node(args.threads_per_node, host_cpus, len(named) * ranks)
    planner = PlannerSettings(**given(PlannerSettings, args))
    replicas = RayReplicas(
        node_bundle(threads, on_gpus), ranks,
        max_restarts=MAX_RESTARTS if args.restart_nodes else 0, log=lines.warn,
    )
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    drain_timeout = None
    try:
        for name, _role in named:
            replicas.place(name)
        try:
            hosts = {replicas.host_of(name, PLACE_TIMEOUT_S) for name, _role in named}
        except TimeoutError as error:
            lines.warn(f"pdserve: {error}")
            return 1
        kv_transport = None
        if not args.colocated:
            across = nodes_across_hosts(hosts, len(alive), planner.enabled)
            kv_transport = ray_kv_transport(args.kv_transport, across, on_gpus)
        here = ray_node_address(ray.get_runtime_context().get_node_id())
        router_address = args.router_listen or f"tcp://{here}:{free_port(here)}"
        secret = args.cluster_secret or secrets.token_urlsafe(32)
        router = plan_router(args, served, router_address, [], secret)
        drain_timeout = router.config.drain_timeout_s
        plans = [
            plan_ray_node(name, role, settings, model, router_address,
                          None if on_gpus else threads, kv_transport,
                          str(served.tokenizer_folder) if served.tokenizer_folder else None)
            for name, role in named
        ]
        secret_env = {SECRET_ENV: secret}
        replicas.start(ROUTER, router.argv, router.env, is_node=False)
        for plan in plans:
            replicas.start(plan.name, plan.argv, {**plan.env, **secret_env})
        url = f"{router_scheme(router.config)}://{args.host}:{args.port}"
        tls_context = router_tls_context(router.config)
        problems: list[str] = []

        def gave_up() -> bool:
            problem = replicas.watch()
            if problem is not None:
                problems.append(problem)
            return problem is not None or bool(stopping)

        try:
            wait_healthy(url, gave_up, READY_TIMEOUT_S, tls_context)
        except RuntimeError as error:
            lines.warn(f"pdserve: {problems[0] if problems else error}")
            return 1
        role_changer = planner_for(
            planner, args, router, tls_context, replicas, plans, secret_env,
            lambda: UNPLACED_ADDRESS, lines.note,
        )
        layout = Role.COLOCATED.value if args.colocated else (
            f"{args.prefill} prefill + {args.decode} decode"
        )
        where = ", ".join(
            f"{name} on {info['host']} (Ray node {info['ray_node_id'][:8]})"
            for name, info in ((name, replicas.where(name)) for name, _role in named)
        )
        lines.say(
            f"pdserve is serving {model} as {', '.join(served.names)} at {url}/v1 ({layout} "
            f"on Ray: {where}; KV over {kv_transport or 'no transport'})"
        )
        return supervise(replicas.watch, role_changer, stopping, lines)
    finally:
        drain = stopping[:1] == [signal.SIGTERM] and drain_timeout is not None
        if drain:
            lines.note(f"pdserve: draining (at most {drain_timeout:g} s)")
        replicas.stop(drain_timeout if drain else None, lambda: len(stopping) > 1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
