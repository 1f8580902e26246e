"""The run-time planner in the launcher: reads the router's signals, asks the policy
(commands/role_planner.py for `--planner load`, commands/slo_policy.py for `slo`), and carries a role change out, one node at a time, without losing
a request.

The launcher's supervision loop calls `step()` a few times a second; each call does at most
one short thing (an admin call to the router on loopback, bounded by its timeout, or a process
signal) and returns. Lifecycle of a change, each stage with its deadline:

  watching   every `--planner-interval`: the signals (GET /admin/nodes), the policy's
             decision. A decision: the router drains the node -> draining.
  draining   the router places no new request on the node; its requests finish as usual
             (router/cluster/node_drain.py). Polled every POLL_S. Empty -> stopping. Past
             `--planner-drain-timeout`: the node is resumed and keeps its role; the give-up is
             logged -> watching.
  stopping   its process is retired (commands/supervisor.py: SIGTERM, SIGKILL after
             STOP_TIMEOUT_S, never restarted). Once it has exited, the router forgets it, and
             the same slot (its GPUs, its threads, its settings) starts in the new role under
             a new node id and address -> starting.
  starting   until the router lists the new node live. Then the change is counted on the
             router (`pdserve_planner_role_changes_total{from,to,reason}`), logged in one line
             (from, to, reason, the signals that decided it, how long each stage took) ->
             watching. Past `--planner-start-timeout` the failure is logged -> watching (the
             supervisor restarts or gives up on the node as on any other).
A router admin call that fails (the router busy or restarting) is tried again at the next
poll; the stage's deadline still holds. Every change, or give-up, restarts the policy's dwell.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.commands.planner_settings import PlannerMode, PlannerSettings
from pdserve.commands.role_planner import LoadPolicy, RoleChange, RolePolicy
from pdserve.commands.router_admin import RouterAdmin, RouterAdminError
from pdserve.commands.slo_policy import SloPolicy
from pdserve.commands.supervisor import STOP_TIMEOUT_S, Deployment
from pdserve.wire.roles import Role

if TYPE_CHECKING:
    from pdserve.commands.launcher import NodePlan

POLL_S = 0.5  # how often a change in progress is checked on
STOP_MARGIN_S = 5.0  # past the supervisor's SIGKILL


class Stage(enum.StrEnum):
    WATCHING = "watching"
    DRAINING = "draining"
    STOPPING = "stopping"
    STARTING = "starting"


def plan_in_role(plan: NodePlan, role: Role, node_id: str, address: str) -> NodePlan:
    """The node `plan` describes, on the same slot (GPUs, threads, settings), as `role` under
    `node_id` at `address`. A decode node's borrowed threads (commands/node_threads.py) are
    not carried over: with the planner on, no node borrows."""
    from pdserve.node.config import CONFIG_ENV

    config = copy.deepcopy(plan.config)
    config["node"].update(node_id=node_id, listen_address=address)
    config["node"].pop("threads_while_prefill_idle", None)
    argv = [*plan.argv[:-1], role.value]
    env = {**plan.env, CONFIG_ENV: json.dumps(config)}
    return dataclasses.replace(
        plan, name=node_id, argv=argv, address=address, config=config, env=env
    )


class RoleChanger:
    """`plans`: the nodes the launcher started; `child_env`: what every node's environment adds
    (the cluster secret); `new_address()`: a free listen address for a node in its new role;
    `log`: one line to the operator."""

    def __init__(
        self,
        settings: PlannerSettings,
        admin: RouterAdmin,
        deployment: Deployment,
        plans: list[NodePlan],
        child_env: dict[str, str],
        new_address: Callable[[], str],
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.admin = admin
        self.deployment = deployment
        self.plans = {plan.name: plan for plan in plans}
        self.names_used = set(self.plans)  # node ids are never reused
        self.child_env = child_env
        self.new_address = new_address
        self.log = log
        self.clock = clock
        now = clock()
        policy = SloPolicy if settings.planner == PlannerMode.SLO else LoadPolicy
        self.policy: RolePolicy = policy(settings, now)
        self.stage = Stage.WATCHING
        self.next_at = now
        self.deadline = float("inf")
        self.change: RoleChange | None = None
        self.new_plan: NodePlan | None = None
        self.stage_times: dict[Stage, float] = {}
        self._admin_error: str | None = None

    def _enter(self, stage: Stage, now: float) -> None:
        self.stage = stage
        self.stage_times[stage] = now
        self.next_at = now + self._poll_s()
        self.deadline = {
            Stage.WATCHING: float("inf"),
            Stage.DRAINING: now + self.settings.planner_drain_timeout_s,
            Stage.STOPPING: now + STOP_TIMEOUT_S + STOP_MARGIN_S,
            Stage.STARTING: now + self.settings.planner_start_timeout_s,
        }[stage]

    def step(self) -> None:
        now = self.clock()
        if now < self.next_at:
            return
        self.next_at = now + self._poll_s()
        try:
            {
                Stage.WATCHING: self._watch,
                Stage.DRAINING: self._drain,
                Stage.STOPPING: self._stop,
                Stage.STARTING: self._start,
            }[self.stage](now)
            self._admin_error = None
        except RouterAdminError as error:
            if str(error) != self._admin_error:  # once per distinct failure
                self.log(f"pdserve: planner: the router's admin routes failed: {error}")
            self._admin_error = str(error)
            if now >= self.deadline:
                self._expire(now)

    def _poll_s(self) -> float:
        return self.settings.planner_interval_s if self.stage is Stage.WATCHING else POLL_S

    def _watch(self, now: float) -> None:
        change = self.policy.decide(self.admin.signals(now))
        if change is not None and change.node_id in self.plans:  # one this launcher started
            self.begin(change, now)

    def begin(self, change: RoleChange, now: float) -> None:
        """Carries `change` out from now on: the router drains its node."""
        self.change = change
        self.admin.drain(change.node_id)
        self.log(f"pdserve: planner: draining {change.describe()}")
        self._enter(Stage.DRAINING, now)

    def _drain(self, now: float) -> None:
        node = self.admin.drain(self.change.node_id)
        if node.state == "empty":
            self.deployment.retire(self.change.node_id)
            self._enter(Stage.STOPPING, now)
        elif now >= self.deadline:
            self._expire(now, f"{node.work} requests left")

    def _stop(self, now: float) -> None:
        old = self.change.node_id
        if not self.deployment.exited(old):
            if now >= self.deadline:
                self._expire(now)
            return
        self.admin.remove(old)
        plan = self.plans.pop(old)
        new_id = self._new_node_id(plan, self.change.to_role)
        self.new_plan = plan_in_role(plan, self.change.to_role, new_id, self.new_address())
        self.plans[new_id] = self.new_plan
        self.deployment.start(new_id, self.new_plan.argv, {**self.new_plan.env, **self.child_env})
        self._enter(Stage.STARTING, now)

    def _start(self, now: float) -> None:
        signals = self.admin.signals(now)
        new_id = self.new_plan.name
        if any(n.node_id == new_id and n.serving for n in signals.nodes):
            change = self.change
            self.admin.record_change(change.from_role, change.to_role, change.reason)
            times = self.stage_times
            self.log(
                f"pdserve: planner: changed {change.describe()}; now node {new_id}, serving "
                f"after {now - times[Stage.DRAINING]:.1f} s (drained in "
                f"{times[Stage.STOPPING] - times[Stage.DRAINING]:.1f} s)"
            )
            self._finish(now)
        elif now >= self.deadline:
            self._expire(now)

    def _expire(self, now: float, detail: str = "") -> None:
        """The stage's deadline passed (module docstring)."""
        change, stage = self.change, self.stage
        if stage is Stage.DRAINING:
            try:
                self.admin.resume(change.node_id)
            except RouterAdminError as error:
                self.log(f"pdserve: planner: could not resume node {change.node_id}: {error}")
            self.log(
                f"pdserve: planner: node {change.node_id} did not drain within "
                f"{self.settings.planner_drain_timeout_s:g} s "
                f"({detail or 'the router unreachable'}); it keeps its role {change.from_role}"
            )
        elif stage is Stage.STOPPING:
            self.log(f"pdserve: planner: node {change.node_id} did not exit; change abandoned")
        elif stage is Stage.STARTING:
            self.log(
                f"pdserve: planner: node {self.new_plan.name} ({change.to_role}) was not serving "
                f"within {self.settings.planner_start_timeout_s:g} s"
            )
        self._finish(now)

    def _finish(self, now: float) -> None:
        self.change = self.new_plan = None
        self.stage_times = {}
        self.policy.changed(now)
        self._enter(Stage.WATCHING, now)

    def _new_node_id(self, plan: NodePlan, role: Role) -> str:
        """`ROLE-N.PORT` as the launcher names nodes (commands/launcher.py), N the next number
        of that role this deployment never used."""
        suffix = plan.name.partition(".")[2]
        index = 0
        while f"{role.value}-{index}.{suffix}" in self.names_used:
            index += 1
        self.names_used.add(f"{role.value}-{index}.{suffix}")
        return f"{role.value}-{index}.{suffix}"
