"""Which heads, rows and vocabulary each tensor-parallel rank holds (engine/distributed/
layout.py), the refusals naming the numbers, and the worker messages' round trip."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.batch import build_flat_batch
from pdserve.engine.config import EngineConfig
from pdserve.engine.distributed.layout import ShardLayout
from pdserve.engine.distributed.messages import BlockSwap, StepInputs, decode, encode
from pdserve.engine.layers.parallel import take_shard


def layout(rank, size, heads=8, kv_heads=4, head_dim=2, intermediate=16, vocab=10):
    return ShardLayout.for_rank(rank, size, heads, kv_heads, head_dim, intermediate, vocab)


def test_sharded_kv_heads_split_evenly():
    ranks = [layout(r, 2) for r in range(2)]
    assert [(lay.first_head, lay.num_heads) for lay in ranks] == [(0, 4), (4, 4)]
    assert [(lay.first_kv_head, lay.num_kv_heads) for lay in ranks] == [(0, 2), (2, 2)]
    assert [lay.rows("kv") for lay in ranks] == [slice(0, 4), slice(4, 8)]
    assert [lay.rows("mlp") for lay in ranks] == [slice(0, 8), slice(8, 16)]
    assert not ranks[0].kv_replicated


def test_fewer_kv_heads_than_ranks_replicate_each_on_the_ranks_that_read_it():
    ranks = [layout(r, 4, kv_heads=2) for r in range(4)]
    assert [lay.first_kv_head for lay in ranks] == [0, 0, 1, 1]
    assert all(lay.num_kv_heads == 1 and lay.kv_replicated for lay in ranks)
    # query heads 0-1 and 2-3 read KV head 0 (8 heads over 2 KV heads: 4 per KV head)
    assert [lay.first_head for lay in ranks] == [0, 2, 4, 6]


def test_vocabulary_rows_are_padded_on_the_last_rank():
    ranks = [layout(r, 4) for r in range(4)]  # 10 rows over 4 ranks: 3 each, 2 of padding
    assert [lay.rows("vocab") for lay in ranks][-1] == slice(9, 12)
    weight = torch.arange(10.0).unsqueeze(1)
    assert take_shard(weight, ranks[3], "rows", "vocab", "weight").flatten().tolist() == [
        9.0,
        0.0,
        0.0,
    ]


def test_row_parallel_bias_is_whole_on_rank_zero_only():
    bias = torch.ones(3)
    assert take_shard(bias, layout(0, 2), "columns", "q", "bias").tolist() == [1.0] * 3
    assert take_shard(bias, layout(1, 2), "columns", "q", "bias").tolist() == [0.0] * 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"heads": 6, "kv_heads": 6},
            "tensor_parallel_size 4 does not divide the model's 6 attention heads",
        ),
        ({"intermediate": 18}, "does not divide the model's intermediate_size 18"),
        ({"heads": 12, "kv_heads": 6}, "does not divide the model's 6 KV heads"),
        (
            {"heads": 12, "kv_heads": 3},
            "3 KV heads (num_key_value_heads) are fewer than tensor_parallel_size 4",
        ),
    ],
)
def test_a_model_the_ranks_cannot_split_is_refused_naming_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout(0, 4, **kwargs)


def test_tensor_parallel_size_is_checked_and_turns_cuda_graphs_off():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cuda_graphs are not supported with"):
        EngineConfig(tensor_parallel_size=2, attention_backend="triton", cuda_graphs=True)
    assert EngineConfig(tensor_parallel_size=2, attention_backend="triton").cuda_graphs is False


def test_step_inputs_and_swaps_survive_the_pipe_encoding():
    batch = build_flat_batch(
        token_chunks=[[5], [7, 8, 9]],
        context_lens=[20, 0],
        block_tables=[[3, 4], [6]],
        sample_flags=[True, True],
        block_size=16,
        device=torch.device("cpu"),
    )
    rows = torch.tensor([0, 3, 1])
    frame = encode(StepInputs([(1, 2)], batch, rows))
    message = decode(frame[8:], torch.device("cpu"))
    assert isinstance(message, StepInputs)
    assert message.blocks_to_copy == [(1, 2)]
    assert message.logits_indices.tolist() == [0, 3, 1]
    got = message.batch
    for name in ("input_ids", "positions", "slot_mapping"):
        assert torch.equal(getattr(got, name), getattr(batch, name))
    assert (got.query_start, got.context_lens, got.seq_lens, got.block_tables) == (
        batch.query_start,
        batch.context_lens,
        batch.seq_lens,
        batch.block_tables,
    )
    swap = decode(encode(BlockSwap(to_host=False, pairs=[(0, 9), (1, 8)]))[8:], "cpu")
    assert swap == BlockSwap(to_host=False, pairs=[(0, 9), (1, 8)])


def test_a_malformed_message_is_refused():
    with pytest.raises(ValueError, match="malformed"):
        decode(b"\x00" * 24, torch.device("cpu"))
