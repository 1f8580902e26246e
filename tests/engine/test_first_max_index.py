"""The sampler's argmax (`max`'s indices, faster on the CPU) picks what `argmax` picks: the
first of equal maxima, in fp32 and bf16, with -inf (suppressed tokens) in the rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sample.sampler import first_max_index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_equals_argmax_ties_and_masked_tokens_included(dtype):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 4099, generator=generator).to(dtype)
    rows[:, ::7] = float("-inf")
    rows[5, [10, 900, 4000]] = 50.0  # a tie: the first wins
    rows[6] = 1.0  # all equal
    rows[7, :-1] = float("-inf")  # only the last token left
    assert torch.equal(first_max_index(rows), rows.argmax(dim=-1))
    assert first_max_index(rows)[[5, 6, 7]].tolist() == [10, 0, 4098]
