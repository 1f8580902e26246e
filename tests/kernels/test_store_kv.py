"""store_kv writes exactly the slots it is given (skipping -1) and nothing else, like its
reference, on the pairwise shape grid; its wrapper rejects bad arguments before launching."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import store_kv_reference
from pdserve.kernels.store_kv import store_kv
from tests.kernels.kernel_cases import DEVICE, PAIRWISE_CASES, KernelCase, paged_cache, random_rows


def slots_with_padding(case: KernelCase, num_blocks: int, num_tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.head_dim)
    slots = torch.randperm(num_blocks * case.block_size, generator=generator)[:num_tokens]
    slots[::4] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=lambda c: c.id)
def test_store_kv_writes_each_token_to_its_slot_and_skips_padding(case):
    num_blocks, num_tokens = 6, 13
    _, key_cache, value_cache = paged_cache(case, num_blocks, seed=1)
    # Keys and values as the model makes them: strided views of one fused projection.
    fused = random_rows(num_tokens, 3 * case.num_kv_heads, case, seed=2)
    key = fused[:, : case.num_kv_heads]
    value = fused[:, 2 * case.num_kv_heads :]
    slots = slots_with_padding(case, num_blocks, num_tokens)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    store_kv_reference(key, value, expected_keys, expected_values, slots)

    store_kv(key, value, key_cache, value_cache, slots)

    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


def test_store_kv_handles_a_head_count_that_is_not_a_power_of_two():
    case = KernelCase(block_size=16, head_dim=80, group=1, dtype=torch.float16)
    buffer = torch.zeros(1, 2, 4, 3, 16, 80, dtype=torch.float16, device=DEVICE)
    key = torch.randn(5, 3, 80, device=DEVICE).to(case.dtype)
    value = torch.randn(5, 3, 80, device=DEVICE).to(case.dtype)
    slots = torch.tensor([0, 17, -1, 63, 40], device=DEVICE)

    store_kv(key, value, buffer[0, 0], buffer[0, 1], slots)

    written = slots >= 0
    assert torch.equal(buffer[0, 0][slots[written] // 16, :, slots[written] % 16], key[written])
    assert torch.equal(buffer[0, 1][slots[written] // 16, :, slots[written] % 16], value[written])
    assert buffer.count_nonzero() == 2 * int(written.sum()) * 3 * 80  # nothing else touched


def test_store_kv_with_no_tokens_is_a_no_op():
    cache = torch.zeros(2, 1, 8, 64, device=DEVICE)
    empty = torch.zeros(0, 1, 64, device=DEVICE)
    store_kv(empty, empty, cache, cache.clone(), torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert not cache.any()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"key": torch.zeros(4, 2, 32)}, "key must be"),
        ({"value": torch.zeros(4, 2, 64, dtype=torch.float16)}, "value is torch.float16"),
        ({"slot_mapping": torch.zeros(3, dtype=torch.long)}, "must agree"),
        ({"slot_mapping": torch.zeros(4)}, "int32/int64"),
        ({"value_cache": torch.zeros(2, 2, 16, 64)}, "differs from key_cache"),
        ({"key": torch.zeros(4, 2, 64, 2)[..., 0]}, "contiguous"),
    ],
)
def test_store_kv_rejects_bad_arguments_with_the_reason(change, message):
    arguments = {
        "key": torch.zeros(4, 2, 64),
        "value": torch.zeros(4, 2, 64),
        "key_cache": torch.zeros(2, 2, 8, 64),
        "value_cache": torch.zeros(2, 2, 8, 64),
        "slot_mapping": torch.zeros(4, dtype=torch.long),
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        store_kv(**arguments)
