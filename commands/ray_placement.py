"""What each pdserve node asks Ray for, and the KV transport that follows from where Ray put it.

Pure decisions, from what the Ray cluster reports (commands/ray_launcher.py asks it):
  - a node's bundle, one per tensor-parallel rank: one GPU and one CPU on a cluster with GPUs;
    else `threads` CPUs, its torch threads;
  - `threads`: `--threads-per-node` where given; else the cluster's CPUs shared equally among
    the nodes, at most the CPUs of its largest host, at least one;
  - the KV transport: `--kv-transport` where given; else, as commands/launcher.py's `auto`, the
    one-host kind (cuda_ipc on GPUs, shm on CPUs) when every node is on one Ray node and stays
    there, else the across-hosts kind (mooncake where installed, else zmq). Nodes stay on one Ray
    node when the cluster has only that one, or when nothing adds replicas later (the run-time
    planner starts a node's replacement wherever Ray finds room). Two Ray nodes on one machine
    count as two hosts: that is how a test stands one machine in for two.
"""

from __future__ import annotations


def threads_per_node(requested: int | None, host_cpus: list[float], node_count: int) -> int:
    """`requested`, else an equal share of the cluster's CPUs (`host_cpus`: one entry per
    alive Ray node), at most the largest host's, at least 1."""
    if requested is not None:
        return requested
    if not host_cpus:
        return 1
    share = int(sum(host_cpus) // max(1, node_count))
    return max(1, min(share, int(max(host_cpus))))


def node_bundle(threads: int, on_gpus: bool) -> dict[str, float]:
    """The resources of one rank of a node."""
    return {"GPU": 1.0, "CPU": 1.0} if on_gpus else {"CPU": float(threads)}


def nodes_across_hosts(placed_hosts: set[str], cluster_hosts: int, replicas_may_change: bool) -> bool:
    """Whether KV must cross hosts (module docstring): the nodes were placed on more than one
    Ray node, or later replicas may land on another of a cluster that has several."""
    return len(placed_hosts) > 1 or (replicas_may_change and cluster_hosts > 1)
