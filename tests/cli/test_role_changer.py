"""The launcher's role changer (commands/role_changer.py) against a real router app served by
uvicorn in a thread, through the real admin client: a node that does not drain in time is
resumed in its old role, and the give-up is logged. The launcher's clock is the test's, so
the drain timeout passes without waiting for it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdserve.commands.launcher import NodePlan
from pdserve.commands.planner_settings import PlannerSettings
from pdserve.commands.role_changer import RoleChanger, Stage
from pdserve.commands.role_planner import ChangeReason, RoleChange
from pdserve.commands.router_admin import RouterAdmin
from pdserve.commands.supervisor import Deployment
from pdserve.router.api.app import create_app
from pdserve.router.cluster.inflight import InFlight
from pdserve.router.config import RouterConfig
from pdserve.text.tokenizer import load_tokenizer
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.free_ports import free_port
from pdserve.wire.roles import Role
from tests.node_stats import node_stats
from tests.router.served import serving

SECRET = "the role changer test's cluster secret"


def test_a_node_that_does_not_drain_in_time_keeps_its_role_and_serves_again(tiny_llama_dir):
    auth = ClusterAuth.from_secret(SECRET)
    config = RouterConfig(
        model_path=Path("unused"), served_model_name="tiny", cluster_auth=auth,
        node_addresses=[f"tcp://127.0.0.1:{free_port()}"],
        listen_address=f"tcp://127.0.0.1:{free_port()}",
    )
    app = create_app(config, tokenizer=load_tokenizer(tiny_llama_dir))
    client = app.state.router.client
    client.registry.nodes.clear()
    for node_id in ("d0", "d1"):
        client.record_stats(node_stats(
            node_id=node_id, role="decode", listen_address=f"tcp://127.0.0.1:{free_port()}",
        ))
    d0 = client.registry.find("d0")
    client.inflight.add("r1", InFlight(asyncio.Queue(), d0))  # a stream that never ends here
    now = [1000.0]
    lines: list[str] = []
    settings = PlannerSettings(planner="load", planner_drain_timeout_s=5.0)
    plan = NodePlan("d0", ["python", "-m", "pdserve.node", "decode"], "tcp://x", {})
    with serving(app) as url:
        changer = RoleChanger(
            settings, RouterAdmin(url, auth.admin_token()), Deployment(before_exec=None),
            [plan], {}, lambda: "tcp://127.0.0.1:1", lines.append, clock=lambda: now[0],
        )
        change = RoleChange("d0", Role.DECODE, Role.PREFILL, ChangeReason.PREFILL_QUEUE, "s")
        changer.begin(change, now[0])
        assert d0.draining and client.live_node().node_id == "d1"
        for _ in range(3):  # polled while the drain runs: still held, still draining
            now[0] += 1.0
            changer.step()
        assert changer.stage is Stage.DRAINING and d0.draining
        now[0] += 5.0
        changer.step()
    assert changer.stage is Stage.WATCHING and not d0.draining
    assert lines[-1] == (
        "pdserve: planner: node d0 did not drain within 5 s (1 requests left); "
        "it keeps its role decode"
    )
    assert changer.policy.last_change_at == now[0]  # the dwell starts again
    assert client.registry.find("d0") is d0  # neither stopped nor removed
