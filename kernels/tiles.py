"""Tile sizes of the attention kernels, from the dtype, the head dim and the device's shared
memory per block.

What a program keeps in shared memory is the operands of its `tl.dot`s: the query tile, and the
key and value tiles loaded in the loop, each held `num_stages` times over by the software
pipeline, plus the weights tile fed to the second product. `prefill_shared_bytes` and
`decode_shared_bytes` count those at the width the products read them (4 bytes in fp32, 2 in
fp16/bf16), an upper bound on what Triton allocates for these kernels. Candidates are listed
largest first; the first whose count fits the device is used. The ceiling differs by a factor
of two across the GPUs in service (99 KiB on sm_86/sm_89, 163 KiB on sm_80, 227 KiB on sm_90),
and fp32 tiles are twice the bytes of 16-bit ones, so one fixed tile cannot serve them all.

Should Triton still refuse a compiled variant (`OutOfResources`), `launch_with_fallback` steps
down to the next candidate and remembers the step for that device, kernel, dtype and head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from triton.runtime.errors import OutOfResources

from pdserve.kernels.launch import MIN_DOT_DIM, dot_dim

KIB = 1024
# Shared memory a block may opt in to, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"); used when torch does not report it.
OPT_IN_SHARED_MEMORY = {
    (7, 0): 96 * KIB,
    (7, 5): 64 * KIB,
    (8, 0): 163 * KIB,
    (8, 6): 99 * KIB,
    (8, 7): 163 * KIB,
    (8, 9): 99 * KIB,
    (9, 0): 227 * KIB,
    (10, 0): 227 * KIB,
    (12, 0): 99 * KIB,
}
# What every CUDA device gives a block without opting in.
PORTABLE_SHARED_MEMORY = 48 * KIB

# (block_m, block_n, num_stages), largest first. The first is what the kernel was designed at.
PREFILL_CANDIDATES = ((64, 64, 2), (64, 32, 2), (32, 32, 2), (32, 16, 1), (16, 16, 1))
# (decode tile, num_stages), largest first.
DECODE_CANDIDATES = ((64, 2), (32, 2), (16, 2), (16, 1))
NUM_WARPS = 4


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int
    block_n: int
    num_stages: int
    num_warps: int = NUM_WARPS


@dataclass(frozen=True)
class DecodeTiles:
    tile: int
    num_stages: int
    num_warps: int = NUM_WARPS


@dataclass(frozen=True)
class TileConfig:
    """Tiles of both attention kernels for one dtype and head dim on one device."""

    prefill: PrefillTiles
    decode: DecodeTiles


def dot_element_bytes(dtype: torch.dtype) -> int:
    """Bytes of one `tl.dot` operand element: fp32 stays fp32, fp16/bf16 stay 16-bit."""
    return 4 if dtype == torch.float32 else 2


def prefill_shared_bytes(
    block_m: int, block_n: int, head_dim: int, dtype: torch.dtype, num_stages: int
) -> int:
    """q [block_m, d] once, keys and values [block_n, d] per stage, weights [block_m, block_n]."""
    width = dot_dim(head_dim)
    elements = block_m * width + num_stages * 2 * block_n * width + block_m * block_n
    return elements * dot_element_bytes(dtype)


def decode_shared_bytes(
    tile: int, head_dim: int, dtype: torch.dtype, num_stages: int, group_rows: int = MIN_DOT_DIM
) -> int:
    """q [group_rows, d] once, keys and values [tile, d] per stage, weights [group_rows, tile]."""
    width = dot_dim(head_dim)
    elements = group_rows * width + num_stages * 2 * tile * width + group_rows * tile
    return elements * dot_element_bytes(dtype)


def prefill_candidates(
    dtype: torch.dtype, head_dim: int, smem_bytes: int | None
) -> list[PrefillTiles]:
    """Every prefill candidate that fits `smem_bytes` (None: no limit), largest first; the
    smallest candidate alone when none fits, as the last resort."""
    tiles = [PrefillTiles(m, n, stages) for m, n, stages in PREFILL_CANDIDATES]
    fitting = [
        t for t in tiles
        if smem_bytes is None
        or prefill_shared_bytes(t.block_m, t.block_n, head_dim, dtype, t.num_stages) <= smem_bytes
    ]
    return fitting or tiles[-1:]


def decode_candidates(
    dtype: torch.dtype, head_dim: int, smem_bytes: int | None, group_rows: int = MIN_DOT_DIM
) -> list[DecodeTiles]:
    """Every decode candidate that fits `smem_bytes` (None: no limit), largest first."""
    tiles = [DecodeTiles(tile, stages) for tile, stages in DECODE_CANDIDATES]
    fitting = [
        t for t in tiles
        if smem_bytes is None
        or decode_shared_bytes(t.tile, head_dim, dtype, t.num_stages, group_rows) <= smem_bytes
    ]
    return fitting or tiles[-1:]


def tile_config(
    dtype: torch.dtype, head_dim: int, smem_bytes: int | None, group_rows: int = MIN_DOT_DIM
) -> TileConfig:
    """The largest tiles of both kernels whose shared memory fits `smem_bytes` per block."""
    return TileConfig(
        prefill_candidates(dtype, head_dim, smem_bytes)[0],
        decode_candidates(dtype, head_dim, smem_bytes, group_rows)[0],
    )


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    properties = torch.cuda.get_device_properties(index)
    reported = getattr(properties, "shared_memory_per_block_optin", None)
    if reported:
        return int(reported)
    return OPT_IN_SHARED_MEMORY.get((properties.major, properties.minor), PORTABLE_SHARED_MEMORY)


def device_shared_memory(device: torch.device) -> int | None:
    """Shared memory a block may use on `device` (opt-in limit); None off CUDA (the
    interpreter has no such limit)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_shared_memory(index)


Tiles = TypeVar("Tiles")
# (device, kernel name, dtype, head dim) -> how many candidates Triton refused there. Facts
# about the hardware, the same for every engine in the process.
_refused_candidates: dict[tuple[object, ...], int] = {}


def launch_with_fallback(
    key: tuple[object, ...], candidates: Sequence[Tiles], launch: Callable[[Tiles], None]
) -> Tiles:
    """Calls `launch(tiles)` with the first candidate Triton accepts, starting after any it
    refused before under `key`; returns the candidate used. Raises the last OutOfResources when
    every candidate is refused."""
    if not candidates:
        raise ValueError(f"no tile candidates to launch {key}")
    index = min(_refused_candidates.get(key, 0), len(candidates) - 1)
    while True:
        try:
            launch(candidates[index])
        except OutOfResources:
            if index + 1 == len(candidates):
                raise
            index += 1
            _refused_candidates[key] = index
            continue
        return candidates[index]
