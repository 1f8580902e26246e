"""What both launchers (commands/launcher.py on one host, commands/ray_launcher.py on Ray) do
once the deployment is ready: build the run-time planner where it is on, then supervise until
a signal, a few rounds a second."""

from __future__ import annotations

import argparse
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.commands.operator_lines import OperatorLines
from pdserve.commands.planner_settings import PlannerSettings
from pdserve.commands.role_changer import RoleChanger
from pdserve.commands.router_admin import RouterAdmin, admin_url
from pdserve.commands.router_tls import router_scheme

if TYPE_CHECKING:
    from pdserve.commands.launcher import NodePlan


def planner_for(
    planner: PlannerSettings, args: argparse.Namespace, router: Any,
    tls_context: ssl.SSLContext | None, deployment: Any, plans: list[NodePlan],
    child_env: dict[str, str], new_address: Callable[[], str], log: Callable[[str], None],
) -> RoleChanger | None:
    """The run-time planner of a ready deployment (`router`: its RouterPlan; `deployment`: a
    supervisor's Deployment or commands/ray_replicas.py's RayReplicas), or None when off."""
    if not planner.enabled:
        return None
    admin = RouterAdmin(
        admin_url(args.host, args.port, router_scheme(router.config)),
        router.config.cluster_auth.admin_token(), tls_context=tls_context,
    )
    return RoleChanger(planner, admin, deployment, plans, child_env, new_address, log)


def supervise(
    watch: Callable[[], str | None], role_changer: RoleChanger | None, stopping: list[int],
    lines: OperatorLines,
) -> int:
    """The supervision loop once the deployment is ready: `watch()` (why it must stop, or None)
    and the planner's step a few times a second, until a signal lands in `stopping`; the exit
    status."""
    while not stopping:
        problem = watch()
        if problem is not None:
            lines.warn(f"pdserve: {problem}; stopping")
            return 1
        if role_changer is not None:
            role_changer.step()
        time.sleep(0.2)
    return 0
