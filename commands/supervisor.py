"""The launcher's child processes: started, watched, restarted, stopped, cleaned up after.

Every child (the router, each node) is one `Child` with the argv that starts it. On Linux each
asks the kernel for SIGTERM when the launcher dies (PR_SET_PDEATHSIG), so even a `kill -9` of
the launcher leaves no orphan behind. Each runs in a session of its own, so a terminal's Ctrl-C
reaches the launcher alone, which stops every child once, in order (below): each says one line
and none prints a traceback.

Lifecycle of a node child after the deployment is ready:
  running     until it exits (a crash, a kill).
  exited      its shared-memory KV segment, if it had one, is removed (its owner is gone, and
              the name is this deployment's); with restarts on it starts again, same argv (same
              node id and listen address) after RESTART_DELAY_S, and rejoins the router by its
              heartbeat; nothing else restarts. A node that exits within QUICK_EXIT_S of its
              start MAX_QUICK_EXITS times in a row is crash-looping: `watch()` reports it.
Retiring (`retire`, the run-time planner's, commands/role_changer.py, once the router has
drained the node): SIGTERM at once, SIGKILL after STOP_TIMEOUT_S; once it has exited, its KV
segment is removed and the child is forgotten, never restarted (`exited()` says when).
Stopping (`stop`): with a drain timeout, the router gets SIGTERM first (it answers 503 to new
requests and lets those in flight finish, router/api/drain.py) and up to that timeout plus
ROUTER_SHUTDOWN_S to exit, while the nodes keep serving; then every child still running gets
SIGINT (router) or SIGTERM (nodes), STOP_TIMEOUT_S to exit, and SIGKILL after. Last, every
segment named after one of the nodes is removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.commands.child_logs import ChildLogs

_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 10.0
ROUTER_SHUTDOWN_S = 10.0
RESTART_DELAY_S = 1.0
QUICK_EXIT_S = 30.0
MAX_QUICK_EXITS = 3
# The shm KV transport names a decode node's segment so (engine/kv/shared_segment.py).
SHM_DIR = Path("/dev/shm")
KV_SEGMENT_PREFIX = "pdserve-kv-"


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook asking the kernel for SIGTERM when the launcher dies (Linux only).

    libc is loaded here, in the parent, so the child between fork and exec only makes one
    async-signal-safe system call.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    is_node: bool
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None
    retiring_since: float | None = None  # `Deployment.retire`d: SIGTERM sent then

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Deployment:
    children: list[Child] = field(default_factory=list)
    restart_nodes: bool = True
    before_exec: Callable[[], None] | None = field(default_factory=_parent_death_signal)
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr))
    # Where children write their output (commands/child_logs.py); None: the launcher's own.
    child_logs: ChildLogs | None = None

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, is_node: bool = True
    ) -> None:
        child = Child(name, argv, {**os.environ, **(env or {}), "PDSERVE_ROLE": name}, is_node)
        self.children.append(child)
        self._spawn(child)

    def _spawn(self, child: Child) -> None:
        hook, logs = self.before_exec, self.child_logs
        output = logs.open_for_child(child.name) if logs is not None else None
        stderr = subprocess.STDOUT if output is not None else None
        try:
            child.process = subprocess.Popen(
                child.argv, env=child.env, stdout=output, stderr=stderr,
                preexec_fn=hook,  # noqa: PLW1509
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher alone
            )
        finally:
            if output is not None:
                output.close()  # the child holds its own handle
        child.started_at = time.monotonic()
        child.restart_at = None

    def retire(self, name: str) -> None:
        """Stops node `name` for good (module docstring); KeyError for a name not started."""
        child = next((c for c in self.children if c.name == name and c.is_node), None)
        if child is None:
            raise KeyError(f"no node {name!r} was started")
        child.retiring_since = time.monotonic()
        child.restart_at = None
        if child.running():
            child.process.send_signal(signal.SIGTERM)

    def exited(self, name: str) -> bool:
        """Whether no child of that name is left (a retired one is forgotten once it exited)."""
        return not any(c.name == name for c in self.children)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if not c.running()), None)

    def watch(self) -> str | None:
        """One supervision round after start-up: restarts nodes that exited (when enabled) and
        returns why the deployment must stop (the router exited, a node crash-loops), or None."""
        now = time.monotonic()
        for child in list(self.children):
            if child.retiring_since is not None:
                self._watch_retiring(child, now)
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self.log(f"pdserve: restarting {child.name}")
                    self._spawn(child)
                continue
            if child.running():
                continue
            status = child.process.returncode
            if not child.is_node:
                return f"the {child.name} exited with status {status}"
            remove_kv_segment(child.name)
            quick = now - child.started_at < QUICK_EXIT_S
            child.quick_exits = child.quick_exits + 1 if quick else 1
            if child.quick_exits >= MAX_QUICK_EXITS:
                return f"node {child.name} exited {child.quick_exits} times in a row soon after start"
            if self.restart_nodes:
                self.log(f"pdserve: node {child.name} exited with status {status}; restarting")
                child.restart_at = now + RESTART_DELAY_S
            else:
                self.log(f"pdserve: node {child.name} exited with status {status}")
                child.restart_at = float("inf")  # never: the deployment serves without it
        return None

    def _watch_retiring(self, child: Child, now: float) -> None:
        if child.running():
            if now - child.retiring_since > STOP_TIMEOUT_S:
                child.process.kill()
            return
        remove_kv_segment(child.name)
        self.children.remove(child)
        self.log(f"pdserve: node {child.name} retired (status {child.process.returncode})")

    def stop(
        self, drain_timeout_s: float | None = None, interrupted: Callable[[], bool] = lambda: False
    ) -> None:
        """Stops every child (draining the router first when `drain_timeout_s` is given; a
        true `interrupted()` cuts the drain short) and removes the nodes' KV segments."""
        router = next((c for c in self.children if not c.is_node and c.running()), None)
        if drain_timeout_s is not None and router is not None:
            router.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + drain_timeout_s + ROUTER_SHUTDOWN_S
            while router.running() and time.monotonic() < deadline and not interrupted():
                time.sleep(0.1)
        for child in self.children:
            if child.running():
                child.process.send_signal(signal.SIGTERM if child.is_node else signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        for child in self.children:
            if child.is_node:
                remove_kv_segment(child.name)


def remove_kv_segment(node_id: str) -> None:
    """Removes the shared-memory KV segment named after a node this deployment started and
    that has exited (a killed decode node cannot remove its own)."""
    try:
        (SHM_DIR / f"{KV_SEGMENT_PREFIX}{node_id}").unlink()
    except (FileNotFoundError, NotADirectoryError):
        pass
