"""Disaggregated serving with tensor parallelism: a prefill node and a decode node of two ranks
each, in this process (each starts one worker rank), give the greedy tokens of a one-rank
colocated engine, and every block of both nodes returns.

Each node keeps every rank's KV shard in one node cache (engine/kv/shared_kv_cache.py), and a
transfer moves it whole: prefill rank r's shard lands in decode rank r's. Checked over shm,
zmq and Mooncake, with sharded KV heads and with one KV head replicated on
both ranks. A pair whose sizes differ is refused at pairing, naming tensor_parallel_size on
both sides, and every block returns after the router's abort. A killed worker rank stops its
node, prefill or decode (RankFailure), instead of failing request after request.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest

from pdserve.decode_node.node import DecodeNode
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.distributed.group import RankFailure
from pdserve.prefill_node.node import PrefillNode
from pdserve.testing.tiny_models import save_tiny_model
from pdserve.wire.messages import RequestFailed
from tests.mooncake_env import require_mooncake
from tests.nodes.test_disaggregated_nodes import (
    assert_all_blocks_free,
    run_until_idle,
    tokens_by_request,
)
from tests.nodes.test_fp8_disaggregated_nodes import (
    abort_and_check_every_block_returns,
    refusal_at_pairing,
    submit,
)
from tests.nodes.unlooped import capture_sends, unlooped_config

NEW_TOKENS = 12
PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 33, 70))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("disaggregated-tp")
    # llama: 2 KV heads, 1 per rank; llama3-rope-tied: 1 KV head, replicated on both ranks.
    return {kind: save_tiny_model(kind, root / kind) for kind in ("llama", "llama3-rope-tied")}


def make_nodes(
    model_dir: Path, transport: str, prefill_ranks: int, decode_ranks: int, tag: str
) -> tuple[DecodeNode, PrefillNode]:
    def engine_config(ranks: int, **extra) -> EngineConfig:
        return EngineConfig(
            model=str(model_dir), dtype="float32", num_kv_blocks=48,
            tensor_parallel_size=ranks, **extra,
        )

    decode = DecodeNode(
        engine_config=engine_config(decode_ranks),
        config=unlooped_config(f"d{tag}", kv_transport=transport),
    )
    try:
        prefill = PrefillNode(
            engine_config=engine_config(prefill_ranks, max_num_batched_tokens=32),
            config=unlooped_config(f"p{tag}", kv_transport=transport),
        )
    except BaseException:
        decode.shutdown()
        raise
    capture_sends(decode)
    capture_sends(prefill)
    return decode, prefill


def shut_down(tag: str, *nodes) -> None:
    for node in nodes:
        node.shutdown()
        workers = node.engine.runner.workers
        assert workers is None or all(p.poll() is not None for p in workers.processes)
    assert not list(Path("/dev/shm").glob(f"pdserve-kv-*{tag}*"))


def expected_tokens(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy)]


@pytest.mark.parametrize(
    ("kind", "transport"),
    [
        ("llama", "shm"),
        ("llama", "zmq"),
        ("llama", "mooncake"),
        ("llama3-rope-tied", "shm"),
    ],
)
def test_two_ranks_on_each_side_give_one_ranks_tokens(model_dirs, kind, transport):
    if transport == "mooncake":
        require_mooncake()
    expected = expected_tokens(model_dirs[kind])
    tag = uuid.uuid4().hex[:10]
    decode, prefill = make_nodes(model_dirs[kind], transport, 2, 2, tag)
    try:
        assert decode.descriptor.tensor_parallel_size == 2
        node_cache = decode.engine.runner.node_kv_cache
        assert node_cache.spec.num_layers == 2 * decode.engine.model_config.num_layers
        submit(decode, PROMPTS, NEW_TOKENS)
        to_router = run_until_idle(decode, prefill)
        assert not [m for m in to_router if isinstance(m, RequestFailed)]
        tokens = tokens_by_request(to_router)
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
        assert prefill.transfer_bytes > 0 and decode.transfer_failures == 0
        assert_all_blocks_free(decode, prefill)
        sizes = [node.stats().identity.tensor_parallel_size for node in (decode, prefill)]
        assert sizes == [2, 2]
    finally:
        shut_down(tag, prefill, decode)


def test_a_pair_of_different_sizes_is_refused_naming_both(model_dirs):
    tag = uuid.uuid4().hex[:10]
    decode, prefill = make_nodes(model_dirs["llama"], "shm", 2, 1, tag)
    try:
        failure = refusal_at_pairing(decode, prefill)
        assert failure.status == 400
        assert "tensor_parallel_size is 1 on decode node" in failure.message
        assert "and 2 on this prefill node" in failure.message
        abort_and_check_every_block_returns(decode, prefill, failure)
    finally:
        shut_down(tag, prefill, decode)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_killed_worker_rank_stops_its_node(model_dirs, role):
    tag = uuid.uuid4().hex[:10]
    decode, prefill = make_nodes(model_dirs["llama"], "shm", 2, 2, tag)
    try:
        node = prefill if role == "prefill" else decode
        (worker,) = node.engine.runner.workers.processes
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        submit(decode, [list(range(3, 40))], 4)
        with pytest.raises(RankFailure, match="rank 1"):
            run_until_idle(decode, prefill)  # never a request's failure: the node stops
    finally:
        shut_down(tag, prefill, decode)
