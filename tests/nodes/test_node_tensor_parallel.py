"""Nodes and tensor parallelism: disaggregated nodes refuse it on GPUs before they load
anything (a KV transfer moves a node cache of every rank's shard, which exists on the CPU:
engine/kv/shared_kv_cache.py), and a failed rank stops a node's generation loop instead of
failing request after request. Disaggregated serving with tensor parallelism on the CPU:
tests/nodes/test_disaggregated_tensor_parallel.py."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.distributed.group import RankFailure
from pdserve.node.config import NodeConfig
from pdserve.node.generation import Generation
from pdserve.node.runtime import refuse_tensor_parallel_on_gpu


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_disaggregated_node_refuses_ranks_on_gpus_only(role):
    refuse_tensor_parallel_on_gpu(EngineConfig(device="cpu", tensor_parallel_size=2), role)
    refuse_tensor_parallel_on_gpu(EngineConfig(device="cuda"), role)
    with pytest.raises(ValueError, match=f"on cuda is not supported for {role} nodes yet"):
        refuse_tensor_parallel_on_gpu(EngineConfig(device="cuda", tensor_parallel_size=2), role)


@pytest.mark.parametrize("module", ["prefill_node", "decode_node"])
def test_the_node_refuses_before_building_its_engine(module, tmp_path):
    import importlib

    node_class = {
        "prefill_node": lambda m: m.PrefillNode,
        "decode_node": lambda m: m.DecodeNode,
    }[module](importlib.import_module(f"pdserve.{module}.node"))
    config = NodeConfig(
        node_id="n", listen_address="tcp://127.0.0.1:0", router_address="tcp://127.0.0.1:1"
    )
    engine_config = EngineConfig(model=str(tmp_path), device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="use a colocated node"):
        node_class(engine_config=engine_config, config=config)


class BrokenRanksEngine:
    def has_unfinished_requests(self) -> bool:
        return True

    def step(self):
        raise RankFailure("tensor-parallel rank 1 (pid 1) exited with code -9")


def test_a_failed_rank_stops_the_generation_loop():
    generation = Generation(BrokenRanksEngine(), "node-0")
    with pytest.raises(RankFailure, match="rank 1"):
        generation.step()
