"""What every kernel wrapper shares: where a kernel can run, and argument checks that fail with
what was wrong before anything is launched.

A Triton kernel runs on CUDA tensors (compiled), or on any tensors in Triton's interpreter when
`TRITON_INTERPRET=1` was set before triton was first imported (triton decides at import, once per
process). Elsewhere - CPU tensors without the interpreter - the wrappers run the pure-torch
reference (kernels/reference.py) instead, so every wrapper works on every device.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# An fp8 cache stores x / scale in one byte and is read as float(x) * scale (reference.py);
# queries, keys and values given to the kernels stay in a compute dtype.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
CACHE_DTYPES = (*COMPUTE_DTYPES, *FP8_CACHE_DTYPES)
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2_E = 1.4426950408889634
# Passed as the window when there is none: wider than any sequence, so the window's mask and
# start (position - window) change nothing and the kernels need no branch for it.
NO_WINDOW = 1 << 30


def kernel_runs_on(kernel: object, device: torch.device) -> bool:
    """Whether launching `kernel` (a `triton.jit` function) on tensors of `device` works."""
    if not isinstance(kernel, InterpretedFunction):
        return device.type == "cuda"
    language_interpreted = isinstance(tl.max, InterpretedFunction)
    if not language_interpreted:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported: the kernels were built for "
            "the interpreter but triton's own functions were not; set it before any import"
        )
    return True


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# Every dimension of a `tl.dot` operand is padded to at least this: compiled Triton asks for
# M, N, K >= 16 with 16-bit operands on NVIDIA GPUs (the interpreter accepts any size, so only a
# compiled run would catch a smaller one).
MIN_DOT_DIM = 16


def dot_dim(n: int) -> int:
    """`n` padded to a power of two that `tl.dot` accepts as a dimension."""
    return max(MIN_DOT_DIM, next_power_of_2(n))


def dot_operands(dtype: torch.dtype, kernel: object) -> tuple[object, str]:
    """(dtype `tl.dot` operands are converted to, input precision) for inputs of `dtype`.

    fp32 products run in full precision, "ieee" (tf32 would cost ~3 decimal digits). 16-bit
    inputs go to the tensor cores as they are; input precision only chooses how fp32 operands
    are rounded, so they get Triton's own default, "tf32", which every backend accepts. Triton's
    interpreter multiplies bf16 operands as their raw 16-bit integers, so under it they are
    widened to fp32 first (exact: same products); compiled kernels never widen.
    """
    widen = dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction)
    if dtype == torch.float32 or widen:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


def check_paged_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, num_kv_heads, block_size, head_dim], same layout, dims contiguous."""
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} strides {value_cache.stride()} differs from "
            f"key_cache {tuple(key_cache.shape)} strides {key_cache.stride()}"
        )
    if key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"caches must share one dtype of {CACHE_DTYPES}, got {key_cache.dtype} and "
            f"{value_cache.dtype}"
        )
    if key_cache.stride(-1) != 1:
        raise ValueError(f"cache head_dim must be contiguous, strides are {key_cache.stride()}")
    if key_cache.device != value_cache.device:
        raise ValueError(f"caches on {key_cache.device} and {value_cache.device}")


def check_rows(name: str, tensor: torch.Tensor, heads: int, head_dim: int, like: torch.Tensor):
    """`tensor` is [tokens, heads, head_dim] with contiguous head_dim, on `like`'s device/dtype."""
    _check_rows(name, tensor, heads, head_dim, like.dtype, like.device)


def check_rows_for_cache(
    name: str, tensor: torch.Tensor, heads: int, head_dim: int, cache: torch.Tensor
) -> None:
    """`check_rows` against `cache`, except that an fp8 cache takes rows of any compute dtype
    (they are converted when stored, and the cache converted when read)."""
    dtype = cache.dtype
    if dtype in FP8_CACHE_DTYPES:
        if tensor.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"{name} is {tensor.dtype}; over an fp8 cache it must be one of {COMPUTE_DTYPES}"
            )
        dtype = tensor.dtype
    _check_rows(name, tensor, heads, head_dim, dtype, cache.device)


def _check_rows(
    name: str,
    tensor: torch.Tensor,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if tensor.dim() != 3 or tensor.shape[1:] != (heads, head_dim):
        raise ValueError(
            f"{name} must be [tokens, {heads}, {head_dim}], got {tuple(tensor.shape)}"
        )
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} head_dim must be contiguous, strides are {tensor.stride()}")
    if tensor.dtype != dtype or tensor.device != device:
        raise ValueError(f"{name} is {tensor.dtype} on {tensor.device}; expected {dtype} on {device}")


def check_scales(k_scale: float, v_scale: float) -> None:
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not 0 < scale < float("inf"):
            raise ValueError(f"{name} must be positive and finite, got {scale}")


def check_index(name: str, tensor: torch.Tensor, dims: int, device: torch.device) -> None:
    """An integer index tensor of `dims` dimensions on `device`, contiguous in its last dim."""
    if tensor.dim() != dims or tensor.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{name} must be a {dims}-d int32/int64 tensor, got {tensor.dim()}-d {tensor.dtype}"
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
    if tensor.numel() and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {tensor.stride()}")
