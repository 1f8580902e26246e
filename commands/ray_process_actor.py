"""`ProcessActor`: one pdserve process (a node, or the router) run inside a Ray actor.

`pdserve serve --ray` (commands/ray_launcher.py) asks Ray for one actor per process; Ray places
it on a host with the resources it asks for, and the actor starts the same process the launcher
starts on one host (`python -m pdserve.node ROLE`, `python -m pdserve.router`), with the same
settings in its environment. A node listens on the address of the host Ray placed it on (a free
port there): its settings' `listen_address` is rewritten here, and the node tells the router
that address by its heartbeat (router/cluster/node_registry.py follows a node to its new
address when it comes back elsewhere).

Lifecycle of an actor:
  starting   Ray placed the actor; `__init__` starts the child from a thread that lives as
             long as the child (the kernel's parent-death signal follows the thread that
             started a process: the child dies with this actor's worker process, however that
             dies: `ray.kill`, the host's OOM killer, its raylet gone).
  running    until the child exits.
  exited     the child exited unasked (a crash, a kill): its shared-memory KV segment is
             removed and the actor's worker exits at once, so Ray restarts the actor (at most
             the `max_restarts` it was created with), which starts the child again under the
             same node id, wherever Ray places it; past them Ray calls the actor dead.
  retiring   `retire()`: SIGTERM to the child, SIGKILL after its timeout; the actor stays, idle,
             until the caller kills it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from pdserve.commands.supervisor import _parent_death_signal, remove_kv_segment
from pdserve.node.config import CONFIG_ENV
from pdserve.wire.free_ports import free_port


def ray_node_address(ray_node_id: str) -> str:
    """The address Ray knows a Ray node by (`ray start --node-ip-address`, else the one Ray
    found): where the processes placed there listen."""
    import ray

    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == ray_node_id)


class ProcessActor:
    """`name`: the node id (or "router"); `argv`, `env`: the process, as the launcher plans it
    (commands/launcher.py NodePlan, commands/router_plan.py RouterPlan)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        import ray

        self.name = name
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.host = ray_node_address(self.ray_node_id)
        self.env = {**os.environ, **env, "PDSERVE_ROLE": name}
        self.address = None
        if CONFIG_ENV in env:  # a node: it listens on this host
            config = json.loads(env[CONFIG_ENV])
            self.address = f"tcp://{self.host}:{free_port(self.host)}"
            config["node"]["listen_address"] = self.address
            self.env[CONFIG_ENV] = json.dumps(config)
        self.argv = argv
        self.retiring = False
        self.process: subprocess.Popen | None = None
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        """Starts the child and waits for it, on this thread (module docstring)."""
        try:
            self.process = subprocess.Popen(
                self.argv, env=self.env, preexec_fn=_parent_death_signal(),  # noqa: PLW1509
                start_new_session=True,
            )
        finally:
            started.set()
        status = self.process.wait()
        if self.retiring:
            return
        if self.address is not None:
            remove_kv_segment(self.name)
        print(f"pdserve: {self.name} exited with status {status}; its actor exits for Ray to "
              "restart it", file=sys.stderr, flush=True)
        os._exit(1)

    def info(self) -> dict[str, object]:
        """Where the process runs: its pid, this host's address, the Ray node, its listen
        address (nodes)."""
        return {
            "name": self.name, "pid": self.process.pid, "host": self.host,
            "ray_node_id": self.ray_node_id, "address": self.address,
        }

    def retire(self, timeout_s: float) -> int:
        """Stops the child for good (SIGTERM, SIGKILL after `timeout_s`); its exit status."""
        self.retiring = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.address is not None:
            remove_kv_segment(self.name)
        return self.process.returncode
