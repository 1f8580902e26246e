"""The processes of a running server, seen from outside through /proc: who each child of a
`pdserve serve` deployment is (the router, or a node by its id), how much memory it holds, and
how much CPU time it, or a whole process tree of any server, has used."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from pdserve.node.config import CONFIG_ENV as NODE_CONFIG_ENV


def status_kib(pid: int, name: str) -> int | None:
    """A `kB` line of /proc/PID/status (VmRSS, VmHWM); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(f"{name}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process has used (/proc/PID/stat); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _parent_ids() -> dict[int, int]:
    """pid -> parent pid of every process /proc shows now."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as stat:
                    parents[int(entry.name)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every process descended from it that is alive now."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parent_ids().items():
        children.setdefault(parent, []).append(pid)
    tree, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return tree


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU time (user + system) used so far by `root_pid` and its live descendants: the cost of
    a server made of several processes (a launcher, a router, nodes, engine workers)."""
    return sum(cpu_seconds(pid) or 0.0 for pid in process_tree(root_pid))


def process_label(argv: list[str], node_config: str | None = None) -> str:
    """`router`, or a node's id without its per-deployment suffix (`prefill-0`): from its
    command line, or from the settings `pdserve serve` hands it as data (`node_config`, the
    JSON of its PDSERVE_NODE_CONFIG)."""
    if "--node-id" in argv[:-1]:
        return argv[argv.index("--node-id") + 1].split(".")[0]
    if node_config is not None:
        return json.loads(node_config)["node"]["node_id"].split(".")[0]
    if "-m" in argv[:-1]:  # `-m pdserve.router`, or `-m pdserve.node ROLE`
        module, *rest = argv[argv.index("-m") + 1:]
        return rest[0] if module == "pdserve.node" and rest else module.removeprefix("pdserve.")
    return Path(argv[0]).name if argv else "?"


def server_processes(launcher_pid: int) -> dict[str, int]:
    """The launcher's children (the router and the nodes) by label, found through the parent
    ids in /proc/*/stat."""
    found: dict[str, int] = {}
    for pid, parent in _parent_ids().items():
        if parent != launcher_pid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = [a.decode(errors="replace") for a in cmdline.read().split(b"\0") if a]
            with open(f"/proc/{pid}/environ", "rb") as environ:
                prefix = f"{NODE_CONFIG_ENV}=".encode()
                config = next(
                    (e[len(prefix) :].decode() for e in environ.read().split(b"\0")
                     if e.startswith(prefix)),
                    None,
                )
            label = process_label(argv, config)
        except (OSError, ValueError, IndexError, KeyError):
            continue
        found[label if label not in found else f"{label} ({pid})"] = pid
    return dict(sorted(found.items()))


def sample_rss(pids: dict[str, int], peaks: dict[str, int]) -> None:
    """Raises each label's peak in `peaks` to its process's VmRSS now (KiB)."""
    for label, pid in pids.items():
        kib = status_kib(pid, "VmRSS")
        if kib is not None:
            peaks[label] = max(peaks.get(label, 0), kib)


async def sample_rss_every(
    interval_s: float, pids: dict[str, int], peaks: dict[str, int]
) -> None:
    """Keeps `peaks` (label -> largest VmRSS in KiB) up to date until cancelled."""
    while True:
        sample_rss(pids, peaks)
        await asyncio.sleep(interval_s)
