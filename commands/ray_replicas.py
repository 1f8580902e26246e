"""`RayReplicas`: a deployment's processes as Ray actors, supervised from the launcher.

The Ray counterpart of commands/supervisor.py's `Deployment`, with the same calls the launcher
and the run-time planner (commands/role_changer.py) make: `start`, `retire`, `exited`, `watch`,
`stop`. A role change of the planner is thus a replica change: one actor of the old role
retired and removed, one of the new role started wherever Ray finds room.

Each node asks Ray for a placement group of its own: one bundle per tensor-parallel rank
(`resources`, e.g. {"CPU": 2} or {"GPU": 1, "CPU": 1}), packed on one host (STRICT_PACK); its
actor runs in the first bundle, and the ranks it starts itself take the rest. The router's
actor asks for no resource and is pinned to the launcher's own Ray node, so its HTTP port is
where the operator started `pdserve serve --ray`.

Lifecycle of a node replica:
  placing    its placement group waits for resources (as long as Ray needs; `pdserve serve`
             waits for the router's /health, which needs every node).
  running    its actor runs the process (commands/ray_process_actor.py). Ray restarts an actor
             whose process exited, at most `max_restarts` times (none with --no-restart-nodes);
             `watch()` asks each actor where it runs every WATCH_S and logs a restart (a new
             pid or host) in one line.
  dead       Ray gave up on it: `watch()` logs it once and forgets it, its placement group
             released; the deployment serves on without it. The router dead for good is the
             deployment's end: `watch()` returns why.
  retiring   `retire()` (the planner, once the router drained the node): the process is stopped
             (SIGTERM, SIGKILL after STOP_TIMEOUT_S), then the actor killed and the group
             released; `exited()` says when.
`stop()` retires the router first (SIGTERM: it drains, at most the drain timeout), then every
node at once, then kills every actor and releases every group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.commands.supervisor import ROUTER_SHUTDOWN_S, STOP_TIMEOUT_S

WATCH_S = 2.0
ROUTER = "router"


@dataclass
class Replica:
    name: str
    actor: Any
    placement_group: Any = None  # None: the router
    where: dict[str, Any] | None = None  # the actor's last info()
    asking: Any = None  # an info() call in flight
    asked_at: float = float("-inf")
    retiring: Any = None  # the retire() call in flight


@dataclass
class RayReplicas:
    """`bundle`: the resources of one rank of a node; `ranks`: bundles per node;
    `max_restarts`: Ray's restarts of an actor; `log`: one line to the operator."""

    bundle: dict[str, float]
    ranks: int = 1
    max_restarts: int = 4
    log: Callable[[str], None] = print
    replicas: dict[str, Replica] = field(default_factory=dict)
    placed: dict[str, Any] = field(default_factory=dict)  # groups made before their actor

    def place(self, name: str) -> None:
        """Asks Ray for node `name`'s placement group ahead of its actor; returns at once."""
        self.placed[name] = self._group(name)

    def host_of(self, name: str, timeout_s: float) -> str:
        """The Ray node id of the host a placed node's group is on, once Ray placed it;
        TimeoutError naming what it asked for when Ray has no room within `timeout_s`."""
        import ray

        group = self.placed[name]
        done, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not done:
            raise TimeoutError(
                f"Ray found no room for node {name} within {timeout_s:g} s: it asks for "
                f"{self.ranks} x {self.bundle} on one host"
            )
        return ray.util.placement_group_table(group)["bundles_to_node_id"][0]

    def _group(self, name: str) -> Any:
        import ray

        return ray.util.placement_group(
            [dict(self.bundle) for _ in range(self.ranks)], strategy="STRICT_PACK",
            name=f"pdserve-{name}",
        )

    def start(self, name: str, argv: list[str], env: dict[str, str], is_node: bool = True) -> None:
        """Starts `name` as an actor (module docstring: where); returns at once."""
        import ray
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        from pdserve.commands.ray_process_actor import ProcessActor

        options: dict[str, Any] = {"max_restarts": self.max_restarts, "max_task_retries": 0}
        group = None
        if is_node:
            group = self.placed.pop(name, None) or self._group(name)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0
            )
            options.update(_bundle_as_options(self.bundle))
        else:
            here = ray.get_runtime_context().get_node_id()
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
            options["num_cpus"] = 0
        actor = ray.remote(ProcessActor).options(**options).remote(name, argv, env)
        self.replicas[name] = Replica(name, actor, group)

    def retire(self, name: str) -> None:
        """Stops node `name` for good (module docstring); KeyError for a name not started."""
        replica = self.replicas[name]
        replica.retiring = replica.actor.retire.remote(STOP_TIMEOUT_S)

    def exited(self, name: str) -> bool:
        """Whether no replica of that name is left (a retired one is released once stopped)."""
        import ray

        replica = self.replicas.get(name)
        if replica is None:
            return True
        if replica.retiring is None:
            return False
        done, _ = ray.wait([replica.retiring], timeout=0)
        if done:
            self._release(replica)
        return bool(done)

    def where(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Where `name` runs now (ProcessActor.info), waiting for it to be placed."""
        import ray

        replica = self.replicas[name]
        replica.where = ray.get(replica.actor.info.remote(), timeout=timeout_s)
        return replica.where

    def watch(self) -> str | None:
        """One supervision round (module docstring); why the deployment must stop, or None."""
        import ray

        now = time.monotonic()
        for replica in list(self.replicas.values()):
            if replica.retiring is not None:
                continue
            if replica.asking is None:
                if now - replica.asked_at >= WATCH_S:
                    replica.asking, replica.asked_at = replica.actor.info.remote(), now
                continue
            done, _ = ray.wait([replica.asking], timeout=0)
            if not done:
                continue
            asking, replica.asking = replica.asking, None
            try:
                where = ray.get(asking)
            except ray.exceptions.ActorDiedError as error:
                if replica.placement_group is None:
                    return f"the router's actor died ({_first_line(error)})"
                self.log(f"pdserve: node {replica.name}: Ray gave up on it ({_first_line(error)}); "
                         "serving without it")
                self._release(replica)
                continue
            except ray.exceptions.RayActorError:
                continue  # being restarted: asked again next round
            previous, replica.where = replica.where, where
            if previous is not None and previous["pid"] != where["pid"]:
                self.log(
                    f"pdserve: {replica.name} restarted by Ray on {where['host']} "
                    f"(pid {where['pid']}, listening at {where['address'] or 'its port'})"
                )
        return None

    def stop(
        self, drain_timeout_s: float | None = None, interrupted: Callable[[], bool] = lambda: False
    ) -> None:
        """Stops every replica (module docstring); a true `interrupted()` cuts the drain short."""
        import ray

        router = self.replicas.get(ROUTER)
        if router is not None and drain_timeout_s is not None:
            router.retiring = router.actor.retire.remote(drain_timeout_s + ROUTER_SHUTDOWN_S)
            deadline = time.monotonic() + drain_timeout_s + ROUTER_SHUTDOWN_S + STOP_TIMEOUT_S
            while not interrupted() and time.monotonic() < deadline:
                done, _ = ray.wait([router.retiring], timeout=0.2)
                if done:
                    break
        calls = [
            replica.actor.retire.remote(STOP_TIMEOUT_S)
            for replica in self.replicas.values() if replica.retiring is None
        ]
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=STOP_TIMEOUT_S + ROUTER_SHUTDOWN_S)
        for replica in list(self.replicas.values()):
            self._release(replica)
        for group in self.placed.values():
            ray.util.remove_placement_group(group)
        self.placed.clear()

    def _release(self, replica: Replica) -> None:
        import ray

        ray.kill(replica.actor, no_restart=True)
        if replica.placement_group is not None:
            ray.util.remove_placement_group(replica.placement_group)
        self.replicas.pop(replica.name, None)


def _bundle_as_options(bundle: dict[str, float]) -> dict[str, Any]:
    """A bundle's resources as an actor's options (num_cpus, num_gpus, resources)."""
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
