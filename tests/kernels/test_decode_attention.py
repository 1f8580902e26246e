"""Split-KV paged decode attention equals its reference on the pairwise shape grid, for
sequence lengths that cross block and split boundaries, padding sequences of length 0, one or
several splits, and a sliding window; the split planner covers every key."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.decode_attention import SplitPlan, decode_attention, plan_splits
from pdserve.kernels.reference import decode_attention_reference
from tests.kernels.kernel_cases import (
    DEVICE,
    PAIRWISE_CASES,
    KernelCase,
    assert_close,
    block_tables,
    paged_cache,
    random_rows,
)

# Every case runs with several splits of 32 keys (lengths up to 71 need three), with one
# split, and with a window of 20 keys (split in two).
VARIANTS = {
    "splits": (None, SplitPlan(num_splits=3, tokens_per_split=32, tile=16)),
    "one-split": (None, SplitPlan(num_splits=1, tokens_per_split=80, tile=16)),
    "window": (20, SplitPlan(num_splits=2, tokens_per_split=16, tile=16)),
}
GRID = [
    pytest.param(case, variant, id=f"{case.id}-{variant}")
    for case in PAIRWISE_CASES
    for variant in VARIANTS
]


def lengths_for(block_size: int) -> list[int]:
    """0 (padding), 1 (no context), either side of a block boundary, and across splits."""
    return [0, 1, block_size - 1, block_size + 1, 2 * block_size, 71]


def run_against_reference(case: KernelCase, seq_lens, sliding_window, plan, num_blocks=40):
    _, key_cache, value_cache = paged_cache(case, num_blocks, seed=3)
    tables = block_tables(seq_lens, case.block_size, num_blocks, seed=4)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(len(seq_lens), case.num_heads, case, seed=5)
    scale = case.head_dim**-0.5
    expected = decode_attention_reference(
        q, key_cache, value_cache, tables, lens, scale, sliding_window
    )
    actual = decode_attention(
        q, key_cache, value_cache, tables, lens, scale, sliding_window, plan=plan
    )
    assert_close(actual, expected, case.dtype)
    return actual


@pytest.mark.parametrize("case, variant", GRID)
def test_decode_attention_matches_reference(case, variant):
    sliding_window, plan = VARIANTS[variant]
    out = run_against_reference(case, lengths_for(case.block_size), sliding_window, plan)
    assert not out[0].any(), "a sequence of length 0 attends to nothing"


def test_decode_attention_plans_its_own_splits_and_writes_into_a_strided_out():
    case = KernelCase(block_size=16, head_dim=64, group=4, dtype=torch.float32)
    seq_lens = [300, 5]
    _, key_cache, value_cache = paged_cache(case, 24, seed=6)
    tables = block_tables(seq_lens, 16, 24, seed=7)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(2, case.num_heads, case, seed=8)
    out = torch.full((2, 2 * case.num_heads, 64), 7.0, device=DEVICE)[:, ::2]

    decode_attention(q, key_cache, value_cache, tables, lens, 0.125, out=out)

    expected = decode_attention_reference(q, key_cache, value_cache, tables, lens, 0.125)
    assert_close(out, expected, case.dtype)


@pytest.mark.parametrize("max_seq_len", [1, 63, 64, 65, 1000, 16384])
@pytest.mark.parametrize("num_seqs", [1, 32, 128])
def test_split_plans_cover_every_key_in_whole_tiles(num_seqs, max_seq_len):
    plan = plan_splits(num_seqs, 8, max_seq_len, num_processors=132)
    assert plan.num_splits * plan.tokens_per_split >= max_seq_len
    assert (plan.num_splits - 1) * plan.tokens_per_split < max_seq_len
    assert plan.tokens_per_split % plan.tile == 0
    assert plan.num_splits == 1 or plan.tokens_per_split >= 256


def test_split_plans_use_one_split_when_the_batch_fills_the_device():
    assert plan_splits(128, 8, 16384, num_processors=132).num_splits == 1
    assert plan_splits(1, 8, 16384, num_processors=132).num_splits > 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"q": torch.zeros(3, 5, 64)}, "do not group"),
        ({"q": torch.zeros(3, 4)}, "must be \\[num_seqs"),
        ({"seq_lens": torch.zeros(2, dtype=torch.int32)}, "sequences"),
        ({"block_tables": torch.zeros(3, dtype=torch.int32)}, "2-d"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"out": torch.zeros(3, 4, 64, dtype=torch.float16)}, "out is torch.float16"),
    ],
)
def test_decode_attention_rejects_bad_arguments_with_the_reason(change, message):
    arguments = {
        "q": torch.zeros(3, 4, 64),
        "key_cache": torch.zeros(4, 2, 16, 64),
        "value_cache": torch.zeros(4, 2, 16, 64),
        "block_tables": torch.zeros(3, 2, dtype=torch.int32),
        "seq_lens": torch.zeros(3, dtype=torch.int32),
        "scale": 0.125,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        decode_attention(**arguments)
