"""Which GPUs `pdserve serve` gives each node, on a CPU machine with the device count and the
launcher's CUDA_VISIBLE_DEVICES mocked: nodes take the launcher's visible GPUs in order
(wrapping when they outnumber them), each node's own GPU comes first, and under cuda_ipc the
prefill node sees the decode node's GPU, so `local_index_of` finds it there."""

from __future__ import annotations

import pytest
import torch

from pdserve.commands.cli import build_parser
from pdserve.commands.launcher import launcher_gpus, place_on_gpus, plan_nodes
from pdserve.kvtransfer.transports import cuda_ipc
from tests.cli.test_serve_flags import child_configs


def fake_gpus(monkeypatch, count: int, visible: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def plan(*flags: str):
    args = build_parser().parse_args(["serve", "--model", "m", *flags])
    return plan_nodes(args, "m", "tcp://127.0.0.1:1")


def setting(node, part: str, name: str):
    """A field value the launcher hands the node as data (None: left to the node)."""
    return node.config[part].get(name)


def visible_in(node) -> list[str]:
    return node.env["CUDA_VISIBLE_DEVICES"].split(",")


def child_view(monkeypatch, visible: list[str]) -> None:
    """torch.cuda as a child started with CUDA_VISIBLE_DEVICES=`visible` sees it: device i is
    the i-th entry, whose identity is the entry itself."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(cuda_ipc, "device_identity", lambda device: visible[device.index])


def test_the_launchers_visible_uuids_map_one_node_to_each_in_order(monkeypatch):
    fake_gpus(monkeypatch, 2, "GPU-aaaa, GPU-bbbb")
    prefill, decode = plan()  # auto transport on CUDA: cuda_ipc
    assert setting(prefill, "node", "kv_transport") == "cuda_ipc"
    assert visible_in(prefill) == ["GPU-aaaa", "GPU-bbbb"]
    assert visible_in(decode) == ["GPU-bbbb", "GPU-aaaa"]
    assert setting(prefill, "engine", "processes_on_device") == 1
    assert setting(decode, "engine", "processes_on_device") == 1


def test_under_cuda_ipc_the_prefill_node_finds_the_decode_nodes_gpu(monkeypatch):
    fake_gpus(monkeypatch, 4, "3,1,0,2")
    prefill, decode = plan("--kv-transport", "cuda_ipc")
    decode_gpu = visible_in(decode)[0]
    assert (visible_in(prefill)[0], decode_gpu) == ("3", "1")
    child_view(monkeypatch, visible_in(prefill))
    assert cuda_ipc.local_index_of(decode_gpu) == 1
    child_view(monkeypatch, visible_in(decode))
    assert cuda_ipc.local_index_of(decode_gpu) == 0  # where the decode node allocates


def test_other_transports_give_each_node_its_own_gpu_alone(monkeypatch):
    fake_gpus(monkeypatch, 2, None)
    prefill, decode = plan("--kv-transport", "zmq")
    assert (visible_in(prefill), visible_in(decode)) == (["0"], ["1"])
    child_view(monkeypatch, visible_in(prefill))
    with pytest.raises(RuntimeError, match=r"GPU 1 is not visible to this process, which sees "
                                           r"\['0'\] \(CUDA_VISIBLE_DEVICES="):
        cuda_ipc.local_index_of("1")


def test_nodes_outnumbering_gpus_wrap_and_count_who_shares_each(monkeypatch):
    fake_gpus(monkeypatch, 2, None)
    nodes = plan("--prefill", "2", "--decode", "3", "--kv-transport", "cuda_ipc")
    assert [visible_in(n)[0] for n in nodes] == ["0", "1", "0", "1", "0"]
    assert [setting(n, "engine", "processes_on_device") for n in nodes] == [3, 2, 3, 2, 3]
    assert all(sorted(visible_in(n)) == ["0", "1"] for n in nodes)


def test_one_gpu_is_shared_by_a_prefill_and_a_decode_node(monkeypatch):
    fake_gpus(monkeypatch, 1, "GPU-only")
    prefill, decode = plan("--gpu-memory-utilization", "0.8")
    assert visible_in(prefill) == visible_in(decode) == ["GPU-only"]
    for node in (prefill, decode):
        assert setting(node, "engine", "processes_on_device") == 2
        assert setting(node, "engine", "gpu_memory_utilization") == 0.8


def test_a_node_sees_only_the_gpus_some_node_uses(monkeypatch):
    fake_gpus(monkeypatch, 8, None)
    prefill, decode = plan("--kv-transport", "cuda_ipc")
    assert (visible_in(prefill), visible_in(decode)) == (["0", "1"], ["1", "0"])


def test_colocated_node_gets_the_first_visible_gpu(monkeypatch):
    fake_gpus(monkeypatch, 2, "5,6")
    (node,) = plan("--colocated")
    assert visible_in(node) == ["5"]
    assert setting(node, "engine", "processes_on_device") == 1


def test_cpu_host_sets_no_device(monkeypatch):
    fake_gpus(monkeypatch, 0, None)
    for node in plan():
        assert "CUDA_VISIBLE_DEVICES" not in node.env
        assert setting(node, "engine", "processes_on_device") is None
        assert setting(node, "node", "kv_transport") == "shm"


def test_launcher_gpus_follow_what_cuda_would_use():
    assert launcher_gpus({}, 3) == ["0", "1", "2"]
    assert launcher_gpus({"CUDA_VISIBLE_DEVICES": "2,0,7"}, 2) == ["2", "0"]
    assert launcher_gpus({"CUDA_VISIBLE_DEVICES": "MIG-x"}, 1) == ["MIG-x"]
    assert launcher_gpus({"CUDA_VISIBLE_DEVICES": ""}, 0) == []
    with pytest.raises(ValueError, match="no GPU"):
        place_on_gpus(2, [], see_every_gpu=False)


def test_serve_device_flags_reach_each_nodes_engine_config(monkeypatch):
    fake_gpus(monkeypatch, 1, None)
    nodes = plan("--attention-backend", "triton", "--enforce-eager",
                 "--gpu-memory-utilization", "0.7", "--load-format", "dummy")
    for node in nodes:
        config = child_configs(node)[0]
        assert (config.attention_backend, config.cuda_graphs) == ("triton", False)
        assert (config.gpu_memory_utilization, config.processes_on_device) == (0.7, 2)
        assert config.load_format == "dummy"


def test_a_tensor_parallel_colocated_node_sees_one_gpu_per_rank(monkeypatch):
    fake_gpus(monkeypatch, 4, "3,1,0,2")
    (node,) = plan("--colocated", "-tp", "2")
    assert visible_in(node) == ["3", "1"]  # rank r runs on the node's cuda:r
    assert setting(node, "engine", "processes_on_device") == 1
    assert setting(node, "engine", "tensor_parallel_size") == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size 8 needs as many GPUs; 4 are"):
        plan("--colocated", "-tp", "8")


def test_tensor_parallel_prefill_and_decode_nodes_are_refused_on_gpus(monkeypatch):
    fake_gpus(monkeypatch, 4, None)
    with pytest.raises(ValueError, match="runs on CPU hosts only.*use --colocated"):
        plan("-tp", "2")
