"""Starts a serving deployment as processes: one node per role and device, plus the router.

Disaggregated (the default): `--prefill N` prefill-node processes and `--decode M` decode-node
processes (on a CPU host each on its share of the cores: commands/node_threads.py), KV moved
over shm between CPU processes or CUDA IPC between GPUs (`--kv-transport` overrides).
Colocated (`--colocated`): one colocated node process that prefills and decodes. Either way one
`router` process, wired over ZeroMQ on free loopback ports. The launcher waits until the
router's /health answers 200 and prints the URL; a process that exits before then stops
everything.

Devices, on a GPU host: the GPUs the launcher may use are the entries of its own
CUDA_VISIBLE_DEVICES (indices or GPU-/MIG- UUIDs, as the operator wrote them), else every GPU.
Node i (prefill nodes first, then decode nodes) runs on the (i mod count)-th of them, so nodes
outnumbering GPUs share them. A node's own GPU comes first in its CUDA_VISIBLE_DEVICES: it is
cuda:0 there, the device a node uses by default. Under cuda_ipc a node must also see its peers'
GPUs (the prefill node opens each decode node's KV buffer on that node's GPU, found by UUID),
so every node's list holds every GPU the deployment uses, its own first; under the other
transports it holds its own GPU alone. Each node gets `--processes-on-device` (how many nodes
share its GPU) and the operator's `--gpu-memory-utilization` (default 0.9), which those nodes
share equally (engine/runner/memory_budget.py). A colocated node with `--tensor-parallel-size N`
(engine/distributed/) sees the first N GPUs and starts its N - 1 worker ranks itself, rank r
on cuda:r; disaggregated nodes run one rank each (N > 1 is refused before anything starts).

Then it supervises (commands/supervisor.py): a node that exits is restarted with the same node id
and address (`--no-restart-nodes`: the deployment serves on without it) and rejoins the router
by its heartbeat, nothing else restarting; the router exiting, or a node crash-looping, stops
everything with status 1. Nodes heartbeat every `--heartbeat-interval` seconds and the router
calls one dead after `--node-timeout` (default: two intervals).

With `--planner load` (commands/planner_settings.py) a run-time planner turns nodes between
prefill and decode while the deployment serves: commands/role_changer.py, stepped from the
supervision loop, drains a node through the router's admin routes, retires its process and
starts its slot in the other role; its nodes borrow no threads (commands/node_threads.py).

SIGTERM drains: the router answers 503 to new requests while those in flight finish (at most
`--drain-timeout` seconds), then the nodes stop, and every child has exited and every
shared-memory segment is gone before the launcher exits 0. SIGINT stops without draining.

Every ZeroMQ link between the children is secured by a cluster secret (wire/cluster_auth.py):
`--cluster-secret`, else a random one made for this run. Children get it in their environment,
never on their command line (which `ps` shows to every user); the router gets `--api-key` there
too. Each child's other settings travel as JSON in its environment as well (node/cli.py,
commands/router_plan.py): its argv names the module alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.commands.allocator import ALLOCATOR_LINE, allocator_environment
from pdserve.commands.child_logs import ChildLogs
from pdserve.commands.model_source import check_model_folder, resolve_served_model
from pdserve.commands.node_threads import plan_node_threads, usable_cores
from pdserve.commands.operator_lines import OperatorLines
from pdserve.commands.planner_settings import PlannerMode, PlannerSettings
from pdserve.commands.router_plan import plan_router
from pdserve.commands.router_tls import router_scheme, router_tls_context
from pdserve.commands.serving_loop import planner_for, supervise
from pdserve.commands.supervisor import Deployment
from pdserve.wire.child_command import python_module_command
from pdserve.wire.cluster_auth import SECRET_ENV
from pdserve.wire.config_flags import given, in_flag_terms
from pdserve.wire.free_ports import free_port
from pdserve.wire.log_format import LogSettings
from pdserve.wire.roles import Role

READY_TIMEOUT_S = 600.0


def node_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The node options given to `pdserve serve`, as field values (node/cli.py's
    PDSERVE_NODE_CONFIG parts); each node's own addresses and device are added per node."""
    from pdserve.engine.config import EngineConfig
    from pdserve.node.config import NodeConfig

    def for_nodes(f: dataclasses.Field) -> bool:  # not the launcher's own, not the router's
        roles = f.metadata.get("roles")
        node_role = roles is None or bool(set(Role) & set(roles))
        return node_role and not f.metadata.get("launcher_sets")

    return {
        "engine": given(EngineConfig, args, select=for_nodes),
        "node": given(NodeConfig, args, select=for_nodes),
        "log": given(LogSettings, args, select=for_nodes),
    }


def check_node_settings(args: argparse.Namespace) -> None:
    """ValueError, with the field and its value, for a node option out of range: checked by
    the dataclasses themselves, before any process starts."""
    from pdserve.engine.config import EngineConfig
    from pdserve.node.config import NodeConfig

    settings = node_settings(args)
    addresses = {"node_id": "-", "listen_address": "-", "router_address": "-"}
    try:
        EngineConfig(**settings["engine"], device="cpu")
    except ValueError as error:
        raise ValueError(in_flag_terms(EngineConfig, str(error))) from None
    try:
        node = NodeConfig(**settings["node"], **addresses)
    except ValueError as error:
        raise ValueError(in_flag_terms(NodeConfig, str(error))) from None
    node_timeout = getattr(args, "node_timeout_s", None)  # a RouterConfig option
    if node_timeout is not None and node_timeout <= node.heartbeat_interval:
        raise ValueError(
            f"--node-timeout {node_timeout:g} must exceed --heartbeat-interval "
            f"{node.heartbeat_interval:g}"
        )


def check_cluster_settings(args: argparse.Namespace) -> None:
    """ValueError for a bad secret, or for a router others should join without one to share."""
    from pdserve.wire.cluster_auth import check_secret, is_loopback

    if args.cluster_secret is not None:
        check_secret(args.cluster_secret)
    elif args.router_listen and not is_loopback(args.router_listen):
        raise ValueError(
            f"--router-listen {args.router_listen} is not a loopback address: give "
            "--cluster-secret (or PDSERVE_CLUSTER_SECRET), which nodes started elsewhere "
            "need to join"
        )


def wait_healthy(
    url: str,
    exited: Callable[[], bool],
    timeout_s: float,
    tls_context: ssl.SSLContext | None = None,
    progress: Callable[[float], None] | None = None,
    progress_every_s: float = 10.0,
) -> None:
    """Returns once `url`/health answers 200 (over `tls_context` for https); RuntimeError if
    `exited()` or on timeout. `progress(seconds waited)` is called every `progress_every_s`."""
    started = time.monotonic()
    deadline = started + timeout_s
    next_progress = started + progress_every_s
    while time.monotonic() < deadline:
        if progress is not None and time.monotonic() >= next_progress:
            progress(time.monotonic() - started)
            next_progress = time.monotonic() + progress_every_s
        if exited():
            raise RuntimeError("a pdserve process exited during start-up")
        try:
            with urllib.request.urlopen(
                f"{url}/health", timeout=2, context=tls_context
            ) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"pdserve did not become ready within {timeout_s:.0f} s")


@dataclass
class NodePlan:
    """One node process: its argv names the module and the role alone; its settings travel as data in
    `env` (node/cli.py's PDSERVE_NODE_CONFIG, `config` as JSON), beside its GPUs."""

    name: str
    argv: list[str]
    address: str
    config: dict[str, dict[str, Any]]
    env: dict[str, str] = field(default_factory=dict)


def choose_kv_transport(requested: str, across_hosts: bool = False) -> str:
    """`auto`: CUDA IPC between the GPUs of this host, shared memory between CPU processes;
    `across_hosts` (nodes may join from other hosts, and every node must use one transport):
    mooncake between CPU processes where it is installed, else zmq. ValueError naming what to
    install when `mooncake` is asked for and cannot run here."""
    if requested not in ("auto", "mooncake"):
        return requested
    import torch

    from pdserve.kvtransfer.transports.mooncake_engine import mooncake_missing

    if requested == "mooncake":
        missing = mooncake_missing()
        if missing is not None:
            raise ValueError(f"--kv-transport mooncake: {missing}")
        return requested
    on_gpus = torch.cuda.is_available()
    if across_hosts:
        return "mooncake" if not on_gpus and mooncake_missing() is None else "zmq"
    return "cuda_ipc" if on_gpus else "shm"


@dataclass(frozen=True)
class DevicePlacement:
    """One node's GPU: the CUDA_VISIBLE_DEVICES entries it sees, its own first, and how many
    nodes of the deployment run on its GPU."""

    visible_devices: tuple[str, ...]
    processes_on_device: int


def launcher_gpus(environ: Mapping[str, str], device_count: int) -> list[str]:
    """The GPUs the launcher may hand out, as CUDA_VISIBLE_DEVICES entries: the launcher's own
    CUDA_VISIBLE_DEVICES (indices or UUIDs) when it is set, else 0..device_count-1. Only the
    first `device_count` entries count: CUDA ignores every entry from the first it cannot use."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(index) for index in range(device_count)]
    entries = [entry.strip() for entry in listed.split(",")]
    return [entry for entry in entries if entry][:device_count]


def place_on_gpus(num_nodes: int, gpus: list[str], see_every_gpu: bool) -> list[DevicePlacement]:
    """Node i runs on gpus[i mod len(gpus)]. With `see_every_gpu` (cuda_ipc) each node also
    sees every other GPU a node of the deployment runs on, after its own."""
    if not gpus:
        raise ValueError("no GPU to place nodes on")
    own = [gpus[index % len(gpus)] for index in range(num_nodes)]
    used = gpus[: min(num_nodes, len(gpus))]
    placements = []
    for device in own:
        others = [other for other in used if other != device] if see_every_gpu else []
        placements.append(DevicePlacement((device, *others), own.count(device)))
    return placements


def plan_nodes(
    args: argparse.Namespace, model: str, router_address: str, tokenizer: str | None = None
) -> list[NodePlan]:
    """One process per node (`tokenizer`: the folder of `--tokenizer`, where given); on a GPU host each runs on one GPU (see the module docstring for
    which and what else it sees), on a CPU host on the threads commands/node_threads.py plans
    (a disjoint share of the cores each, a lone decode node borrowing the rest while no prompt
    of its is being prefilled) unless `--threads-per-node` says otherwise."""
    from pdserve.node.config import CONFIG_ENV

    settings = node_settings(args)
    engine = {**settings["engine"], "model": model}
    if tokenizer is not None:
        engine["tokenizer"] = tokenizer
    node = {**settings["node"], "router_address": router_address}
    across_hosts = False
    if args.colocated:
        roles = [Role.COLOCATED]
    else:
        from pdserve.wire.cluster_auth import is_loopback

        across_hosts = bool(args.router_listen) and not is_loopback(args.router_listen)
        node["kv_transport"] = choose_kv_transport(args.kv_transport, across_hosts)
        roles = [Role.PREFILL] * args.prefill + [Role.DECODE] * args.decode
    gpus = launcher_gpus(os.environ, _gpu_count())
    see_every_gpu = node.get("kv_transport") == "cuda_ipc"
    placements = place_on_gpus(len(roles), gpus, see_every_gpu) if gpus else None
    tensor_parallel_size = engine.get("tensor_parallel_size", 1)
    if placements is not None and tensor_parallel_size > 1 and not args.colocated:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} with prefill and decode nodes "
            "runs on CPU hosts only: shipping each GPU rank's KV shard is not built; use "
            "--colocated for tensor parallelism on GPUs"
        )
    if placements is not None and tensor_parallel_size > 1:  # one colocated node, N GPUs
        if len(gpus) < tensor_parallel_size:
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} needs as many GPUs; "
                f"{len(gpus)} are visible"
            )
        placements = [DevicePlacement(tuple(gpus[:tensor_parallel_size]), 1)]
    roles_may_change = getattr(args, "planner", PlannerMode.OFF) != PlannerMode.OFF
    threads = plan_node_threads(  # a node that may change role borrows nothing
        roles, usable_cores(), bool(gpus), args.threads_per_node,
        others_may_join=across_hosts or roles_may_change,
    )
    plans, counts = [], dict.fromkeys(Role, 0)
    for index, role in enumerate(roles):
        # Unique per deployment on this host: shared-memory segments are named by node id.
        node_id = f"{role}-{counts[role]}.{args.port}"
        counts[role] += 1
        address = f"tcp://127.0.0.1:{free_port()}"
        config = {
            "engine": dict(engine),
            "node": {**node, "node_id": node_id, "listen_address": address},
            "log": settings["log"],
        }
        if threads[index].num_threads is not None:
            config["engine"]["num_threads"] = threads[index].num_threads
        if threads[index].threads_while_prefill_idle is not None:
            config["node"]["threads_while_prefill_idle"] = threads[index].threads_while_prefill_idle
        env = {}
        if placements is not None:
            placement = placements[index]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(placement.visible_devices)
            config["engine"]["processes_on_device"] = placement.processes_on_device
        env[CONFIG_ENV] = json.dumps(config)
        argv = [*python_module_command("pdserve.node"), role.value]
        plans.append(NodePlan(node_id, argv, address, config, env))
    return plans


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _failed_start(deployment: Deployment, error: RuntimeError) -> str:
    """One line: the first child that exited and its last line, or why start-up failed."""
    child = deployment.first_exited()
    logs = deployment.child_logs
    if child is None or logs is None:
        where = f" (process logs in {logs.folder})" if logs is not None else ""
        return f"pdserve: {error}{where}"
    return logs.failed_start_line(child.name, child.process.returncode)


def serve(args: argparse.Namespace) -> int:
    """Finds and checks the model, starts the nodes and the router; runs until interrupted;
    returns the exit status (2: the model cannot be served)."""
    served = resolve_served_model(
        args.model, args.served_model_name, args.revision, args.download_dir, args.tokenizer
    )
    check_model_folder(served.folder, args.load_format, served.tokenizer_folder is None)
    model = str(served.folder)
    router_address = args.router_listen or f"tcp://127.0.0.1:{free_port()}"
    tokenizer = str(served.tokenizer_folder) if served.tokenizer_folder else None
    nodes = plan_nodes(args, model, router_address, tokenizer)
    cluster_secret = args.cluster_secret or secrets.token_urlsafe(32)
    on_gpus = any("CUDA_VISIBLE_DEVICES" in node.env for node in nodes)
    allocator_env, allocator = allocator_environment(os.environ, on_gpus)
    child_env = {SECRET_ENV: cluster_secret, **allocator_env}  # every child, restarts included
    router = plan_router(
        args, served, router_address, [f"{node.name}={node.address}" for node in nodes],
        cluster_secret,
    )
    drain_timeout = router.config.drain_timeout_s
    lines = OperatorLines(args.log_format or "text")
    logs = None
    if not args.verbose:
        logs = ChildLogs(Path(tempfile.mkdtemp(prefix=f"pdserve-{args.port}-logs-")))
        lines.say(f"pdserve: process logs in {logs.folder} (--verbose: here)")
    lines.say(f"{ALLOCATOR_LINE}{allocator}")
    deployment = Deployment(restart_nodes=args.restart_nodes, child_logs=logs, log=lines.warn)
    ready = False
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for node in nodes:
            deployment.start(node.name, node.argv, {**node.env, **child_env})
        deployment.start("router", router.argv, {**router.env, **allocator_env}, is_node=False)
        url = f"{router_scheme(router.config)}://{args.host}:{args.port}"
        tls_context = router_tls_context(router.config)
        try:
            wait_healthy(
                url, lambda: deployment.first_exited() is not None, READY_TIMEOUT_S, tls_context,
                progress=(lambda s: lines.say(logs.starting_line(s))) if logs else None,
            )
        except RuntimeError as error:
            lines.warn(_failed_start(deployment, error))
            return 1
        if logs is not None:
            logs.skip_written()
        ready = True
        planner = PlannerSettings(**given(PlannerSettings, args))
        role_changer = planner_for(
            planner, args, router, tls_context, deployment, nodes, child_env,
            lambda: f"tcp://127.0.0.1:{free_port()}", lines.note,
        )
        layout = Role.COLOCATED.value if args.colocated else f"{args.prefill} prefill + {args.decode} decode"
        lines.say(f"pdserve is serving {model} as {', '.join(served.names)} at {url}/v1 ({layout})")
        secret = "the same --cluster-secret" if args.cluster_secret else (
            "a --cluster-secret this deployment shares (it made its own: give one to share)"
        )
        lines.say(f"nodes started elsewhere join with --router {router_address} and {secret}")
        def watch() -> str | None:
            problem = deployment.watch()
            if logs is not None:
                logs.echo_new()
            return problem

        return supervise(watch, role_changer, stopping, lines)
    finally:
        drain = stopping[:1] == [signal.SIGTERM]
        if drain:
            lines.note(f"pdserve: draining (at most {drain_timeout:g} s)")
        deployment.stop(drain_timeout if drain else None, lambda: len(stopping) > 1)
        if logs is not None and ready:
            logs.echo_new()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
