"""Shared by the kernel tests: the device they run on, the shape grid, random paged caches and
tolerances.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton, so the kernels run on
CPU tensors in Triton's interpreter. Run with TRITON_INTERPRET=0 on a CUDA machine, the same
tests run the compiled kernels on the GPU instead.

The shape grid is pairwise, not a full product: the nine rows of an orthogonal array over
(block size, head dim, GQA group, dtype) put every value of every axis, and every pair of values
of any two axes, in some case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def kernel_test_device() -> torch.device:
    if isinstance(tl.max, InterpretedFunction):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it) and "
        "there is no CUDA device: run the kernel tests with TRITON_INTERPRET=1 in the environment"
    )


DEVICE = kernel_test_device()
BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 80, 128)
GROUPS = (1, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ORTHOGONAL_ARRAY = (
    (0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2),
    (1, 0, 1, 2), (1, 1, 2, 0), (1, 2, 0, 1),
    (2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0),
)
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


@dataclass(frozen=True)
class KernelCase:
    block_size: int
    head_dim: int
    group: int
    dtype: torch.dtype

    @property
    def num_kv_heads(self) -> int:
        return 2 if self.group < 8 else 1

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"bs{self.block_size}-d{self.head_dim}-g{self.group}-{dtype}"


PAIRWISE_CASES = [
    KernelCase(BLOCK_SIZES[b], HEAD_DIMS[d], GROUPS[g], DTYPES[t])
    for b, d, g, t in ORTHOGONAL_ARRAY
]


def paged_cache(case: KernelCase, num_blocks: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(buffer, key_cache, value_cache): random values in the engine's layout; the caches are
    the views of layer 1 of a two-layer buffer, so they start past the buffer's beginning."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 2, num_blocks, case.num_kv_heads, case.block_size, case.head_dim)
    buffer = torch.randn(shape, generator=generator).to(case.dtype).to(DEVICE)
    return buffer, buffer[1, 0], buffer[1, 1]


def block_tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int):
    """int32 [num_seqs, max_blocks]: distinct random blocks for every sequence, padded with 0."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    if sum(counts) > num_blocks:
        raise ValueError(f"{sum(counts)} blocks needed, {num_blocks} in the cache")
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(max(counts, default=0), 1)
    rows, used = [], 0
    for count in counts:
        rows.append(order[used : used + count] + [0] * (width - count))
        used += count
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE).view(-1, width)


def random_rows(rows: int, heads: int, case: KernelCase, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, case.head_dim, generator=generator).to(case.dtype).to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[dtype])
