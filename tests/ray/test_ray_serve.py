"""`pdserve serve --ray` on a real Ray cluster: a head and a second Ray node on loopback, each its
own `ray start` with 2 CPUs (tests/ray/local_cluster.py), one cluster for the module.

  - 1P1D with 2 threads per node: Ray can only place the two nodes on different Ray nodes, so
    KV crosses "hosts" (mooncake where it runs, else zmq); 32 greedy requests give colocated
    serving's text. The decode node's process killed: its actor exits, Ray restarts it, the
    node rejoins the router at its new address, and the same requests give the same text
    again; no block is leaked. The router's process killed: Ray restarts it on the same ports,
    both nodes rejoin it, and the requests give the same text again. Nothing of the deployment
    is left once it stops.
  - 1P2D with the run-time planner forced to turn a decode node into a prefill node under
    streaming load (tests/faults/test_role_planner.py's load policy): the change is a replica
    change, one decode actor retired and one prefill actor started, and every request
    completes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from pdserve.commands.serve_process import ServeProcess
from tests.e2e.test_disaggregated import (
    SERVE_FLAGS,
    requests_with_shared_prefixes,
    run_concurrently,
)
from tests.fault_checks import assert_no_leaked_blocks, live_nodes, metric, wait_until
from tests.faults.test_role_planner import PLANNER, POLICIES, roles, stream_until_changed

pytest.importorskip("ray", reason="the ray extra (pip install 'pdserve[ray]') is not installed")


@pytest.fixture(scope="module")
def ray_cluster():
    from tests.ray.local_cluster import LocalRayCluster

    cluster = LocalRayCluster(cpus=(2, 2))
    try:
        yield cluster
    finally:
        cluster.close()


def pids_of(port: int) -> dict[str, int]:
    """Node id (`router.PORT` for the router) -> pid of every pdserve process of the deployment
    on `port`, wherever it was started (Ray's workers start them, not the launcher), found by
    PDSERVE_ROLE in its environment (and the router by the port in its settings)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(
                v.decode(errors="replace").partition("=")[::2]
                for v in (entry / "environ").read_bytes().split(b"\0") if v
            )
        except OSError:
            continue
        role = environ.get("PDSERVE_ROLE", "")
        if role.endswith(f".{port}"):
            found[role] = int(entry.name)
        elif role == "router" and f'"port": {port},' in environ.get("PDSERVE_ROUTER_CONFIG", ""):
            found[f"router.{port}"] = int(entry.name)
    return found


def test_1p1d_across_two_ray_nodes_equals_colocated_and_survives_a_killed_node(
    ray_cluster, tiny_llama_dir, tmp_path
):
    bodies = requests_with_shared_prefixes()
    colocated = ServeProcess(["--model", str(tiny_llama_dir), *SERVE_FLAGS, "--colocated"])
    try:
        expected = run_concurrently(colocated.url, bodies)
    finally:
        colocated.close()
    log = tmp_path / "serve.log"
    server = ServeProcess(
        ["--ray", ray_cluster.address, "--model", str(tiny_llama_dir), *SERVE_FLAGS,
         "--disagg-policy", "always", "--threads-per-node", "2", "--verbose"],
        ready_timeout_s=240, log_path=log,
    )
    port = server.port
    try:
        wait_until(lambda: "pdserve is serving" in log.read_text(), 60, "the serving line")
        serving = re.search(
            rf"prefill-0\.{port} on \S+ \(Ray node (\w+)\), decode-0\.{port} on \S+ "
            r"\(Ray node (\w+)\); KV over (\w+)", log.read_text(),
        )
        assert serving is not None, log.read_text()[-3000:]
        assert serving[1] != serving[2] and serving[3] in ("mooncake", "zmq")
        wait_until(lambda: len(live_nodes(server.url)) == 2, 60, "both nodes live")
        assert run_concurrently(server.url, bodies) == expected
        assert_no_leaked_blocks(server.url)

        decode = f"decode-0.{port}"
        killed = pids_of(port)[decode]
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: f"{decode} restarted by Ray" in log.read_text(), 120,
                   "the launcher's line about Ray's restart")
        assert pids_of(port).get(decode) not in (None, killed)
        wait_until(lambda: live_nodes(server.url) == {f"prefill-0.{port}", decode}, 120,
                   "the restarted node live again")
        assert run_concurrently(server.url, bodies) == expected
        assert_no_leaked_blocks(server.url)

        router = pids_of(port)[f"router.{port}"]
        os.kill(router, signal.SIGKILL)
        wait_until(lambda: "router restarted by Ray" in log.read_text(), 120,
                   "the launcher's line about the router's restart")
        wait_until(lambda: live_nodes_or_none(server.url) == {f"prefill-0.{port}", decode}, 120,
                   "both nodes rejoined the restarted router")
        assert run_concurrently(server.url, bodies) == expected
        assert_no_leaked_blocks(server.url)
    finally:
        server.close()
    wait_until(lambda: not pids_of(port), 60, "every node process of the deployment gone")


def live_nodes_or_none(url: str) -> set[str] | None:
    """live_nodes, or None while nothing answers at `url` (the router restarting)."""
    try:
        return live_nodes(url)
    except httpx.HTTPError:
        return None


def test_the_planner_changes_a_replica_on_ray_under_load_losing_nothing(
    ray_cluster, tiny_llama_dir, tmp_path
):
    policy_flags, reason = POLICIES["load"]
    log = tmp_path / "serve.log"
    server = ServeProcess(
        ["--ray", ray_cluster.address, "--model", str(tiny_llama_dir), "--prefill", "1",
         "--decode", "2", "--threads-per-node", "1", "--disagg-policy", "always",
         "--kv-cache-memory", str(32 << 20), "--verbose", *PLANNER, *policy_flags],
        ready_timeout_s=240, log_path=log,
    )
    port = server.port
    try:
        wait_until(lambda: len(roles(server.url)) == 3, 120, "3 live nodes")
        results, seen_at = asyncio.run(stream_until_changed(server.url, tiny_llama_dir.name))
        failed = [r for r in results if not (r.completed and r.done)]
        assert not failed, failed[:3]
        assert len(results) > seen_at
        assert metric(server.url, "pdserve_planner_role_changes_total", "from") == {"decode": 1.0}
        wait_until(lambda: sorted(roles(server.url).values()) == ["decode", "prefill", "prefill"],
                   60, "2 prefill + 1 decode live")
        changed = re.search(
            rf"planner: changed node (decode-\d\.{port}): decode -> prefill \(reason "
            rf"{re.escape(reason)}.*\); now node (prefill-\d\.{port})", log.read_text(),
        )
        assert changed is not None, log.read_text()[-3000:]
        assert changed[1] not in pids_of(port) and changed[2] in pids_of(port)
        assert_no_leaked_blocks(server.url)
    finally:
        server.close()
    wait_until(lambda: not pids_of(port), 60, "every node process of the deployment gone")
