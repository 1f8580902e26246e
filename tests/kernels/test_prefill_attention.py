"""Varlen prefill/extend attention over the paged cache equals its reference on the pairwise
shape grid: chunks with and without a cached prefix, chunks and prefixes that cross block and
tile boundaries, an empty chunk, with and without a sliding window; rows outside the chunks are
left alone."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.prefill_attention import prefill_attention
from pdserve.kernels.reference import prefill_attention_reference
from tests.kernels.kernel_cases import (
    DEVICE,
    PAIRWISE_CASES,
    KernelCase,
    assert_close,
    block_tables,
    paged_cache,
    random_rows,
)

# (cached context, new tokens) per sequence: a whole prompt with no context (1 and 37 tokens),
# extends after a partial and after a whole block, a one-token chunk, an empty chunk.
SPANS = [(0, 1), (0, 37), (5, 12), (32, 20), (40, 1), (7, 0)]
LEADING_ROWS = 3  # rows before the first chunk (where the batch's decode tokens would be)
TILES = {"block_m": 16, "block_n": 16}


def run_against_reference(case: KernelCase, spans, sliding_window, num_blocks=40):
    seq_lens = [context + new for context, new in spans]
    _, key_cache, value_cache = paged_cache(case, num_blocks, seed=10)
    tables = block_tables(seq_lens, case.block_size, num_blocks, seed=11)
    offsets = [LEADING_ROWS]
    for _, new in spans:
        offsets.append(offsets[-1] + new)
    query_start = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(offsets[-1], case.num_heads, case, seed=12)
    scale = case.head_dim**-0.5
    expected = prefill_attention_reference(
        q, key_cache, value_cache, tables, query_start, lens, scale, sliding_window
    )
    out = torch.full_like(q, 5.0)
    prefill_attention(
        q, key_cache, value_cache, tables, query_start, lens, max(n for _, n in spans), scale,
        sliding_window, out=out, **TILES,
    )
    assert (out[:LEADING_ROWS] == 5.0).all(), "rows outside every chunk must stay untouched"
    assert_close(out[LEADING_ROWS:], expected[LEADING_ROWS:], case.dtype)


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=lambda c: c.id)
def test_prefill_attention_matches_reference(case):
    run_against_reference(case, SPANS, sliding_window=None)


@pytest.mark.parametrize("case", PAIRWISE_CASES[::2], ids=lambda c: c.id)
def test_prefill_attention_with_a_sliding_window_matches_reference(case):
    run_against_reference(case, SPANS, sliding_window=9)


def test_prefill_attention_with_default_tiles_matches_reference():
    case = KernelCase(block_size=16, head_dim=64, group=4, dtype=torch.float32)
    seq_lens = [150, 70]
    _, key_cache, value_cache = paged_cache(case, 16, seed=13)
    tables = block_tables(seq_lens, 16, 16, seed=14)
    query_start = torch.tensor([0, 130, 200], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(200, case.num_heads, case, seed=15)
    expected = prefill_attention_reference(
        q, key_cache, value_cache, tables, query_start, lens, 0.125, 100
    )
    actual = prefill_attention(
        q, key_cache, value_cache, tables, query_start, lens, 130, 0.125, 100
    )
    assert_close(actual, expected, case.dtype)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"query_start": torch.zeros(2, dtype=torch.int32)}, "num_seqs \\+ 1"),
        ({"q": torch.zeros(6, 4, 32)}, "q must be"),
        ({"block_m": 24}, "power of two"),
        ({"block_n": 8}, "power of two"),
        ({"sliding_window": -1}, "sliding_window"),
        ({"out": torch.zeros(5, 4, 64)}, "out has 5 rows"),
    ],
)
def test_prefill_attention_rejects_bad_arguments_with_the_reason(change, message):
    arguments = {
        "q": torch.zeros(6, 4, 64),
        "key_cache": torch.zeros(4, 2, 16, 64),
        "value_cache": torch.zeros(4, 2, 16, 64),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "query_start": torch.tensor([0, 2, 6], dtype=torch.int32),
        "seq_lens": torch.tensor([2, 4], dtype=torch.int32),
        "max_query_len": 4,
        "scale": 0.125,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        prefill_attention(**arguments)
