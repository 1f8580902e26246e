"""`pdserve serve`'s threads per node on a CPU host (commands/node_threads.py): disjoint equal
shares, a lone decode node borrowing every core while nothing is prefilled for it, the
operator's --threads-per-node as given, and nothing set on a GPU host."""

from __future__ import annotations

import pytest

from pdserve.commands.node_threads import NodeThreads, plan_node_threads


def test_1p1d_on_two_cores_shares_them_and_the_decode_node_borrows_both():
    assert plan_node_threads(["prefill", "decode"], cores=2, on_gpus=False) == [
        NodeThreads(1), NodeThreads(1, threads_while_prefill_idle=2)
    ]


def test_shares_are_disjoint_and_the_lone_decode_node_borrows_every_core():
    plan = plan_node_threads(["prefill", "prefill", "decode"], cores=16, on_gpus=False)
    assert plan == [NodeThreads(5), NodeThreads(5), NodeThreads(5, 16)]
    assert sum(node.num_threads for node in plan) <= 16


def test_with_several_decode_nodes_nothing_is_borrowed():
    plan = plan_node_threads(["prefill", "decode", "decode"], cores=12, on_gpus=False)
    assert plan == [NodeThreads(4)] * 3


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_a_colocated_node_gets_every_core(cores):
    assert plan_node_threads(["colocated"], cores, on_gpus=False) == [NodeThreads(cores)]


def test_fewer_cores_than_nodes_still_gives_each_node_a_thread_and_borrows_nothing():
    plan = plan_node_threads(["prefill", "prefill", "decode"], cores=1, on_gpus=False)
    assert plan == [NodeThreads(1)] * 3


def test_threads_per_node_is_the_operators_layout_with_nothing_borrowed():
    plan = plan_node_threads(["prefill", "decode"], cores=2, on_gpus=False, requested=2)
    assert plan == [NodeThreads(2), NodeThreads(2)]


def test_a_gpu_host_sets_no_thread_count_unless_asked():
    assert plan_node_threads(["prefill", "decode"], 64, on_gpus=True) == [NodeThreads(None)] * 2
    assert plan_node_threads(["decode"], 64, on_gpus=True, requested=4) == [NodeThreads(4)]


def test_the_launcher_hands_each_node_its_planned_threads(monkeypatch):
    from pdserve.commands import launcher
    from tests.cli.test_serve_flags import child_configs, serve_args

    monkeypatch.setattr(launcher, "usable_cores", lambda: 4)
    monkeypatch.setattr(launcher, "_gpu_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = serve_args(["/models/tiny", "--kv-transport", "shm"])
    plans = launcher.plan_nodes(args, "/models/tiny", "tcp://127.0.0.1:27001")
    (prefill_engine, prefill_node, _), (decode_engine, decode_node, _) = map(child_configs, plans)
    assert (prefill_engine.num_threads, prefill_node.threads_while_prefill_idle) == (2, None)
    assert (decode_engine.num_threads, decode_node.threads_while_prefill_idle) == (2, 4)
    args = serve_args(["/models/tiny", "--kv-transport", "shm", "--threads-per-node", "3"])
    plans = launcher.plan_nodes(args, "/models/tiny", "tcp://127.0.0.1:27001")
    for engine, node, _ in map(child_configs, plans):
        assert (engine.num_threads, node.threads_while_prefill_idle) == (3, None)


def test_nothing_is_borrowed_when_nodes_of_other_hosts_may_join():
    plan = plan_node_threads(["prefill", "decode"], cores=8, on_gpus=False, others_may_join=True)
    assert plan == [NodeThreads(4), NodeThreads(4)]
