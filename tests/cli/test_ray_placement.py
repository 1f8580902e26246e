"""What each node asks Ray for and the KV transport that follows (commands/ray_placement.py,
commands/ray_launcher.py): pure decisions, from what a cluster reports."""

from __future__ import annotations

from argparse import Namespace

from pdserve.commands.ray_launcher import node_names, ray_kv_transport
from pdserve.commands.ray_placement import node_bundle, nodes_across_hosts, threads_per_node


def test_threads_are_an_equal_share_capped_by_the_largest_host_unless_given():
    assert threads_per_node(3, [8.0, 8.0], 2) == 3
    assert threads_per_node(None, [8.0, 8.0], 2) == 8
    assert threads_per_node(None, [8.0, 8.0], 3) == 5
    assert threads_per_node(None, [2.0, 64.0], 1) == 64  # all of the largest host, no more
    assert threads_per_node(None, [1.0], 4) == 1
    assert threads_per_node(None, [], 2) == 1


def test_a_bundle_is_one_gpu_or_the_threads_as_cpus():
    assert node_bundle(4, on_gpus=False) == {"CPU": 4.0}
    assert node_bundle(4, on_gpus=True) == {"GPU": 1.0, "CPU": 1.0}


def test_kv_crosses_hosts_when_placed_apart_or_when_replicas_may_land_elsewhere():
    assert not nodes_across_hosts({"a"}, 1, replicas_may_change=True)
    assert not nodes_across_hosts({"a"}, 2, replicas_may_change=False)
    assert nodes_across_hosts({"a"}, 2, replicas_may_change=True)
    assert nodes_across_hosts({"a", "b"}, 2, replicas_may_change=False)


def test_the_transport_follows_the_placement_and_a_named_one_is_kept():
    assert ray_kv_transport("auto", across_hosts=False, on_gpus=False) == "shm"
    assert ray_kv_transport("auto", across_hosts=True, on_gpus=False) in ("mooncake", "zmq")
    assert ray_kv_transport("auto", across_hosts=False, on_gpus=True) == "zmq"
    assert ray_kv_transport("zmq", across_hosts=False, on_gpus=False) == "zmq"


def test_nodes_are_named_as_on_one_host():
    args = Namespace(colocated=False, prefill=2, decode=1, port=8000)
    assert node_names(args) == [
        ("prefill-0.8000", "prefill"), ("prefill-1.8000", "prefill"), ("decode-0.8000", "decode")
    ]
    assert node_names(Namespace(colocated=True, prefill=1, decode=1, port=9)) == [
        ("colocated-0.9", "colocated")
    ]
