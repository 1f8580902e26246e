"""Attention tile sizes fit the shared memory of every GPU generation in service, for every
dtype and head dim the engine meets; the launcher steps down when Triton refuses a tile; and
the kernels stay right where tiles and head dims are padded (a head dim under 16, the sizes
the wrappers choose themselves)."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from pdserve.kernels.decode_attention import SplitPlan, decode_attention
from pdserve.kernels.launch import MIN_DOT_DIM, dot_dim
from pdserve.kernels.prefill_attention import prefill_attention
from pdserve.kernels.reference import decode_attention_reference, prefill_attention_reference
from pdserve.kernels.tiles import (
    DECODE_CANDIDATES,
    OPT_IN_SHARED_MEMORY,
    PREFILL_CANDIDATES,
    decode_shared_bytes,
    device_shared_memory,
    launch_with_fallback,
    prefill_shared_bytes,
    tile_config,
)
from tests.kernels.kernel_cases import (
    DEVICE,
    KernelCase,
    assert_close,
    block_tables,
    paged_cache,
    random_rows,
)

# Shared memory a block may opt in to (bytes), as the devices report it: A100, RTX 30xx/A10,
# RTX 40xx/L4/L40, H100/H200.
SHARED_MEMORY = {"sm_80": 166_912, "sm_86": 101_376, "sm_89": 101_376, "sm_90": 232_448}
ARCHITECTURES = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_chosen_tiles_fit_the_shared_memory_of_each_gpu_generation(arch, dtype, head_dim):
    limit = SHARED_MEMORY[arch]
    assert OPT_IN_SHARED_MEMORY[ARCHITECTURES[arch]] == limit
    for group_rows in (16, 32):
        config = tile_config(dtype, head_dim, limit, group_rows)
        prefill, decode = config.prefill, config.decode
        for size in (prefill.block_m, prefill.block_n, decode.tile):
            assert size >= MIN_DOT_DIM and size & (size - 1) == 0
        assert prefill_shared_bytes(
            prefill.block_m, prefill.block_n, head_dim, dtype, prefill.num_stages
        ) <= limit
        assert decode_shared_bytes(
            decode.tile, head_dim, dtype, decode.num_stages, group_rows
        ) <= limit


def test_large_gpus_keep_the_design_tiles_and_small_ones_shrink_fp32():
    sm90, sm86 = SHARED_MEMORY["sm_90"], SHARED_MEMORY["sm_86"]
    design = PREFILL_CANDIDATES[0][:2]
    for dtype in DTYPES:
        prefill = tile_config(dtype, 128, sm90).prefill
        assert (prefill.block_m, prefill.block_n) == design
        assert tile_config(dtype, 128, sm90).decode.tile == DECODE_CANDIDATES[0][0]
    assert tile_config(torch.bfloat16, 128, sm86).prefill.block_m == design[0]
    fp32 = tile_config(torch.float32, 128, sm86)
    assert fp32.prefill.block_m * fp32.prefill.block_n < design[0] * design[1]
    assert fp32.decode.tile < DECODE_CANDIDATES[0][0]
    # fp32 tiles of the design size need more than sm_86/sm_89 have: the reason for all this.
    assert prefill_shared_bytes(64, 64, 128, torch.float32, 2) > sm86


def test_no_limit_means_the_largest_tiles_and_the_cpu_has_no_limit():
    largest = tile_config(torch.float32, 256, None)
    assert (largest.prefill.block_m, largest.prefill.block_n) == PREFILL_CANDIDATES[0][:2]
    assert device_shared_memory(torch.device("cpu")) is None


def test_a_tiny_limit_still_gets_the_smallest_tiles_as_a_last_resort():
    config = tile_config(torch.float32, 256, 1024)
    assert (config.prefill.block_m, config.prefill.block_n) == PREFILL_CANDIDATES[-1][:2]
    assert config.decode.tile == DECODE_CANDIDATES[-1][0]


def test_dot_dimensions_are_padded_to_sixteen():
    assert [dot_dim(n) for n in (1, 8, 16, 17, 80, 128)] == [16, 16, 16, 32, 128, 128]


def test_the_launcher_steps_down_when_triton_refuses_and_remembers_it():
    tried: list[int] = []

    def launch(size: int) -> None:
        tried.append(size)
        if size > 16:
            raise OutOfResources(size * 1024, 16 * 1024, "shared memory")

    key = ("test-device", "test-kernel", torch.float32, 64)
    assert launch_with_fallback(key, [64, 32, 16], launch) == 16
    assert tried == [64, 32, 16]
    tried.clear()
    assert launch_with_fallback(key, [64, 32, 16], launch) == 16
    assert tried == [16], "a refused tile is not compiled and refused again"


def test_the_launcher_raises_when_every_tile_is_refused():
    def launch(size: int) -> None:
        raise OutOfResources(1 << 20, 1024, "shared memory")

    with pytest.raises(OutOfResources):
        launch_with_fallback(("test-device", "never-fits"), [32, 16], launch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_head_dim_under_sixteen_is_padded_and_stays_exact(dtype):
    case = KernelCase(block_size=16, head_dim=8, group=4, dtype=dtype)
    seq_lens = [1, 20, 35]
    num_blocks = 12
    _, key_cache, value_cache = paged_cache(case, num_blocks, seed=21)
    tables = block_tables(seq_lens, case.block_size, num_blocks, seed=22)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(len(seq_lens), case.num_heads, case, seed=23)
    plan = SplitPlan(num_splits=2, tokens_per_split=32, tile=16)
    actual = decode_attention(q, key_cache, value_cache, tables, lens, 0.3, plan=plan)
    expected = decode_attention_reference(q, key_cache, value_cache, tables, lens, 0.3)
    assert_close(actual, expected, dtype)

    query_start = torch.tensor([0, 1, 9, 14], dtype=torch.int32, device=DEVICE)
    rows = random_rows(14, case.num_heads, case, seed=24)
    actual = prefill_attention(
        rows, key_cache, value_cache, tables, query_start, lens, 8, 0.3, block_m=16, block_n=16
    )
    expected = prefill_attention_reference(
        rows, key_cache, value_cache, tables, query_start, lens, 0.3
    )
    assert_close(actual, expected, dtype)


def test_prefill_without_tile_sizes_picks_its_own_and_matches_the_reference():
    case = KernelCase(block_size=16, head_dim=32, group=2, dtype=torch.float32)
    seq_lens = [70, 9]
    num_blocks = 10
    _, key_cache, value_cache = paged_cache(case, num_blocks, seed=31)
    tables = block_tables(seq_lens, case.block_size, num_blocks, seed=32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query_start = torch.tensor([0, 70, 79], dtype=torch.int32, device=DEVICE)
    q = random_rows(79, case.num_heads, case, seed=33)
    actual = prefill_attention(q, key_cache, value_cache, tables, query_start, lens, 70, 0.2)
    expected = prefill_attention_reference(q, key_cache, value_cache, tables, query_start, lens, 0.2)
    assert_close(actual, expected, case.dtype)
