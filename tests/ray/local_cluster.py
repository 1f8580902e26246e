"""A real Ray cluster on loopback for the tests: a head and a second Ray node, each its own
`ray start --block` process group with its own resources, standing in for two hosts.

Every port a Ray node opens is chosen here (two nodes on one machine would otherwise meet on
Ray's fixed defaults), each node keeps its files in a temporary folder of its own, and
`close()` stops both process groups (SIGTERM, SIGKILL after STOP_TIMEOUT_S), so nothing of
the cluster outlives the test module.

Lifecycle: `LocalRayCluster(...)` returns once both nodes are registered (the head's `ray
status` lists two nodes), or raises with the output of the node that did not come up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.wire.free_ports import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 8.0


def ray_command() -> list[str]:
    """The `ray` command of this interpreter's environment."""
    return [str(Path(sys.executable).with_name("ray"))]


def _node_ports() -> list[str]:
    """Every port flag of `ray start` whose default is fixed, with a free port each."""
    flags = [
        "--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port",
        "--dashboard-agent-listen-port", "--metrics-export-port", "--runtime-env-agent-port",
    ]
    ports = []
    for flag in flags:
        ports += [flag, str(free_port())]
    # Workers take ports Ray chooses itself (0: any free one), not a fixed range per node.
    return [*ports, "--min-worker-port", "0", "--max-worker-port", "0"]


class LocalRayCluster:
    """`cpus`: each node's CPUs as Ray counts them (a logical resource: a test may ask for more
    than the machine has); node i also has the custom resource `host_i` (1)."""

    def __init__(self, cpus: tuple[int, ...] = (2, 2)) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="pdserve-ray-"))
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        try:
            for index, count in enumerate(cpus):
                self._start(index, count)
            self._wait_for_nodes(len(cpus))
        except BaseException:
            self.close()
            raise

    def _start(self, index: int, cpus: int) -> None:
        common = [
            "start", "--block", "--node-ip-address", HOST, "--num-cpus", str(cpus),
            "--num-gpus", "0", "--resources", json.dumps({f"host_{index}": 1}),
            "--object-store-memory", str(80 << 20), "--disable-usage-stats", *_node_ports(),
        ]
        if index == 0:
            role = [
                "--head", "--port", str(self.port), "--include-dashboard", "false",
                "--temp-dir", str(self.folder / "head"),
            ]
            if importlib.util.find_spec("grpc") is not None:  # Ray's client server needs it
                role += ["--ray-client-server-port", str(free_port())]
        else:
            role = ["--address", self.address]
        log = self.folder / f"node-{index}.log"
        self.logs.append(log)
        with open(log, "w") as output:
            self.processes.append(subprocess.Popen(
                [*ray_command(), *common, *role], stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
            ))

    def _wait_for_nodes(self, count: int) -> None:
        """Until `count` Ray nodes are alive, asked of the head's control store."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for process, log in zip(self.processes, self.logs):
                if process.poll() is not None:
                    raise RuntimeError(f"a Ray node exited: {log.read_text()[-3000:]}")
            if self.alive_nodes() >= count:
                return
            time.sleep(1.0)
        raise RuntimeError(
            f"the Ray cluster did not have {count} nodes within {START_TIMEOUT_S:g} s: "
            + " | ".join(log.read_text()[-1500:] for log in self.logs)
        )

    def alive_nodes(self) -> int:
        """How many Ray nodes `ray status` counts active, or 0 while the head
        does not answer."""
        check = subprocess.run(
            [*ray_command(), "status", "--address", self.address], check=False, capture_output=True,
            text=True, timeout=60, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
        if check.returncode != 0:
            return 0
        return _active_nodes(check.stdout)

    def close(self) -> None:
        """The second node first (it drains through the head, which must still answer), then
        the head."""
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            try:  # anything of its group still there
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _active_nodes(status: str) -> int:
    """The node count of `ray status`'s "Active:" section (one line per node, " 1 node_...")."""
    lines = status.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Active:")
    except StopIteration:
        return 0
    count = 0
    for line in lines[start + 1:]:
        words = line.split()
        if len(words) != 2 or not words[1].startswith("node_"):
            break
        count += int(words[0])
    return count
