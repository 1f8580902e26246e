"""Paged decode attention on the CPU: one query token per sequence, its keys read in place.

Compiled by numba (LLVM: no C compiler needed at install or run time). For each (sequence,
KV head) pair - the parallel loop, split over numba's threads, as many as torch uses - the
query heads that share the KV head (as many per call as `heads_per_call` fits in registers)
walk the sequence's blocks through its block table where they lie in the cache: nothing is
gathered or copied, and each block is folded into an online softmax in fp32 (running max,
running denominator, accumulators rescaled when the max grows) by the chunk step of
kernels/cpu_attention_chunk.py, 16 tokens at a time (block sizes that 16 does not divide go in
their largest power-of-two divisor), while the next block is prefetched. With a sliding window
the blocks wholly before it are skipped and the first one is read from the window's start
(masked lanes). An fp32 or bf16 cache is read in place (bf16 as its 16-bit words, widened in
registers); an fp8 cache (float8_e4m3fn) as its bytes, widened into fp32 rows by bit
arithmetic a block at a time: the byte's 7 exponent and mantissa bits go to bits 20-26 of an
fp32 and its exponent is rebiased (+120); a subnormal (exponent 0) is corrected with one
multiply-subtract and the sign applied after, then the layer's key or value scale multiplies
it (vLLM's read: value x scale); exact for every byte. Measured per 16 x 64 block on the
2-core Xeon: 179 ns, against 219 ns for a 256-entry lookup table and 1.8 us for a variant that
left e4m3's subnormals as fp32 subnormals (the CPU's slow path).
The query is converted to fp32 and scaled before the call, and the output converted back after;
head_dim must be a multiple of 16 (`cpu_decode_attention_available`), the engine's gather path
serves the others. Results differ from kernels/reference.py by float rounding only (~1e-6 in the
tests).

Compiled on first use for each (query heads per call, head dim, tokens per chunk) - 3 s on the
benchmark machine - and cached on disk (numba's cache=True: beside this file when writable,
else in the user's cache directory, or NUMBA_CACHE_DIR), so later processes load it in about
0.4 s; where no cache directory is writable, every process compiles it.

Why numba, and why the chunk step is written as LLVM vectors. Measured side by side on
SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, block size 16) on a 2-core Xeon
(AVX-512), fp32, per layer call (bench/results/cpu_decode_attention.md has the full grid):
  candidate                                     b1 ctx2048   b16 ctx512   b64 ctx512
  (a) gather path (index_select, matmuls)         0.68 ms      1.73 ms     12.0 ms
  (c) numba array loops                           0.31 ms      0.77 ms      4.5 ms
(b) pure torch padded to the longest sequence (one index_select per cache, two batched
matmuls, a masked softmax) beat (a) only at batch 1 and 128 tokens (0.05 vs 0.09 ms) and lost
on the columns above (in one run: 0.43 vs 0.41 ms, 7.0 vs 1.3 ms, 70 vs 10 ms): it copies
every padded key and value, transposed. (d) the same loops as (c) in C, gcc -O3
-march=native, ran within 10% of (c) either way (one thread): without hand-written
intrinsics it gains nothing, and it needs a compiler on every user's machine. (c) kept one
horizontal sum per key and a scalar exp per score; (e), this kernel, keeps 16 scores in one
register (a transposing sum tree) and takes their exp at once (a polynomial), and was 1.8-2.2x
(fp32) and 1.5-3.3x (bf16) faster than (c), side by side in a later run whose machine ran (c)
faster than the table's (b64 ctx512: 2.44 -> 1.37 ms fp32, 2.63 -> 1.02 ms bf16). Variants of
(e) that lost: two chunks per softmax update (1.2x slower, with twice the straight-line code
per call), prefetching 2 or 4 blocks ahead instead of 1 (no change). In the offline benchmark
(`make bench`, bf16) decode attention took 5.7 s of the run against 10.4 s with (c), and the
run's throughput rose from 322 to 428 tokens/s. numba is a dependency; where it is missing (or
the cache is fp16) the engine keeps the gather path.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from pdserve.kernels.cpu_attention_chunk import LANES, lane_order
from pdserve.kernels.numba_threads import run_parallel

try:
    import numba
    from numba import njit, prange, types
    from numba.extending import overload

    from pdserve.kernels.cpu_attention_chunk import attention_chunk
    from pdserve.kernels.llvm_prefetch import CACHE_LINE_BYTES, prefetch_element
    from pdserve.kernels.numba_compile import compiled
except ImportError:  # the engine falls back to its gather path
    numba = None

SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def cpu_decode_attention_available(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the compiled kernel can run on a cache of `cache_dtype` and heads of `head_dim`
    (numba importable; head_dim a multiple of 16, the chunk step's vector width)."""
    return (
        numba is not None and cache_dtype in SUPPORTED_CACHE_DTYPES and head_dim % LANES == 0
    )


def heads_per_call(group: int, head_dim: int) -> int:
    """How many of a KV head's `group` query heads one chunk call serves: the most (a divisor
    of the group) whose accumulators fit in 16 vector registers, at least one."""
    vectors_per_head = head_dim // LANES
    return max(
        h for h in range(1, group + 1) if group % h == 0 and (h == 1 or h * vectors_per_head <= 16)
    )


if numba is not None:

    def _block_rows(cache, block, kv_head, scratch, fp8_scale):
        """cache[block, kv_head] ([block_size, head_dim]) as rows the chunk step reads: the
        block itself for an fp32 or bf16 (uint16 words) cache; for an fp8 e4m3 cache (bytes),
        widened into `scratch` (uint32) viewed as fp32, times `fp8_scale`."""

    @overload(_block_rows)
    def _block_rows_impl(cache, block, kv_head, scratch, fp8_scale):
        if cache.dtype in (types.float32, types.uint16):

            def in_place(cache, block, kv_head, scratch, fp8_scale):
                return cache[block, kv_head]

            return in_place
        if cache.dtype == types.uint8:

            def widened_fp8(cache, block, kv_head, scratch, fp8_scale):
                codes = cache[block, kv_head]
                for token in range(codes.shape[0]):
                    for d in range(codes.shape[1]):
                        scratch[token, d] = (
                            (np.uint32(codes[token, d]) & np.uint32(0x7F)) << np.uint32(20)
                        ) + np.uint32(120 << 23)
                values = scratch.view(np.float32)
                for token in range(codes.shape[0]):
                    for d in range(codes.shape[1]):
                        code = codes[token, d]
                        value = values[token, d]
                        if code & np.uint8(0x78) == 0:  # a subnormal: m x 2^-9
                            value = np.float32(2.0) * value - np.float32(2.0**-6)
                        if code & np.uint8(0x80):
                            value = -value
                        values[token, d] = value * fp8_scale
                return values

            return widened_fp8
        return None

    @njit(inline="always")
    def _prefetch_block(key_cache, value_cache, block, kv_head):
        """The blocks of a sequence lie anywhere in the cache, so the hardware prefetchers
        cannot guess the next one: measured with the cache out of the CPU's caches (as in a
        decode step, after the layer's weights), fetching the next block while scoring this one
        made a call 20-30% faster."""
        block_size, dim = key_cache.shape[2], key_cache.shape[3]
        first = (block * key_cache.shape[1] + kv_head) * block_size * dim
        for offset in range(first, first + block_size * dim, CACHE_LINE_BYTES // key_cache.itemsize):
            prefetch_element(key_cache, offset)
            prefetch_element(value_cache, offset)

    def _decode_loops(
        q, key_cache, value_cache, block_tables, seq_lens, window, key_scale, value_scale,
        order, out, heads, head_dim, tokens,
    ):
        """q [seqs, num_heads, head_dim] fp32, already scaled; caches [blocks, kv_heads,
        block_size, head_dim] fp32, uint16 (bf16 words) or uint8 (fp8 e4m3 bytes);
        block_tables [seqs, max_blocks] int32; seq_lens [seqs] int32; window 0 for none;
        key_scale / value_scale fp32, an fp8 cache's scales (unused otherwise); order the
        chunk step's `lane_order`; out [seqs, num_heads, head_dim] fp32; heads (query heads
        per chunk call), head_dim and tokens (per chunk) are compiled in as constants, one
        specialization per combination (numba.literally)."""
        numba.literally(heads)
        numba.literally(head_dim)
        numba.literally(tokens)
        num_seqs, num_heads = q.shape[0], q.shape[1]
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
        group = num_heads // num_kv_heads
        calls = group // heads  # chunk calls per KV head, each for `heads` query heads
        items_per_seq = num_kv_heads * calls
        for item in prange(num_seqs * items_per_seq):
            seq = item // items_per_seq
            call = item - seq * items_per_seq
            kv_head = call // calls
            first_head = kv_head * group + (call - kv_head * calls) * heads
            seq_len = seq_lens[seq]
            if seq_len <= 0:
                out[seq, first_head:first_head + heads] = 0.0
                continue
            first_key = max(0, seq_len - window) if window > 0 else 0
            query = np.empty(heads * head_dim, np.float32)
            for h in range(heads):
                for p in range(head_dim):
                    query[h * head_dim + p] = q[seq, first_head + h, order[p]]
            acc = np.zeros(heads * head_dim, np.float32)
            running_max = np.full(heads, -np.inf, np.float32)
            denominator = np.zeros(heads, np.float32)
            key_scratch = np.empty((block_size, head_dim), np.uint32)
            value_scratch = np.empty((block_size, head_dim), np.uint32)
            last_block = (seq_len - 1) // block_size
            for block_index in range(first_key // block_size, last_block + 1):
                block = block_tables[seq, block_index]
                if block_index < last_block:
                    _prefetch_block(
                        key_cache, value_cache, block_tables[seq, block_index + 1], kv_head
                    )
                keys = _block_rows(key_cache, block, kv_head, key_scratch, key_scale)
                values = _block_rows(value_cache, block, kv_head, value_scratch, value_scale)
                for chunk in range(block_size // tokens):
                    start = block_index * block_size + chunk * tokens
                    lo = max(first_key - start, 0)
                    hi = min(seq_len - start, tokens)
                    if hi <= lo:
                        continue
                    rows = slice(chunk * tokens, (chunk + 1) * tokens)
                    if lo == 0 and hi == tokens:
                        attention_chunk(
                            query, keys[rows], values[rows], acc, running_max, denominator,
                            lo, hi, heads, head_dim, tokens, False,
                        )
                    else:
                        attention_chunk(
                            query, keys[rows], values[rows], acc, running_max, denominator,
                            lo, hi, heads, head_dim, tokens, True,
                        )
            for h in range(heads):
                inverse = np.float32(1.0) / denominator[h]
                for p in range(head_dim):
                    out[seq, first_head + h, order[p]] = acc[h * head_dim + p] * inverse

    decode_kernel = compiled(_decode_loops, parallel=True, fastmath={"reassoc", "contract"})

    @functools.cache
    def compiled_for(heads: int, head_dim: int, tokens: int):
        """`decode_kernel` for these constants, callable from Python at a jitted call's cost:
        a call with a literal argument from Python would be typed twice on every call (tens
        of ms), so Python calls this wrapper, whose constants are its closure's."""

        def decode(
            q, key_cache, value_cache, block_tables, seq_lens, window, key_scale, value_scale,
            order, out,
        ):
            decode_kernel(
                q, key_cache, value_cache, block_tables, seq_lens, window, key_scale,
                value_scale, order, out, heads, head_dim, tokens,
            )

        return compiled(decode)


def cache_array(cache: torch.Tensor) -> np.ndarray:
    """A layer's cache as the kernel reads it (shared memory, no copy): fp32 as is, bf16 as
    its uint16 words, fp8 as its bytes. A caller may keep it for the cache's lifetime."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).numpy()
    return cache.numpy()




def _check_arguments(q, key_cache, value_cache, block_tables, seq_lens, out) -> None:
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "caches must both be [num_blocks, num_kv_heads, block_size, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype not in SUPPORTED_CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"caches must share one dtype of {SUPPORTED_CACHE_DTYPES}, got {key_cache.dtype} "
            f"and {value_cache.dtype}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("caches must be contiguous (a layer's view of the KV buffer is)")
    tensors = (q, key_cache, value_cache, block_tables, seq_lens, out)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"every tensor must be on the CPU, got {[t.device for t in tensors]}")
    num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
    if head_dim % LANES:
        raise ValueError(f"head_dim must be a multiple of {LANES}, got {head_dim}")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q must be [num_seqs, a multiple of {num_kv_heads} heads, {head_dim}], "
            f"got {tuple(q.shape)}"
        )
    if out.shape != q.shape:
        raise ValueError(f"out is {tuple(out.shape)}, q is {tuple(q.shape)}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1:
        raise ValueError(
            f"block_tables must be 2-d and seq_lens 1-d, got {block_tables.dim()}-d and "
            f"{seq_lens.dim()}-d"
        )
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(
            f"q has {q.shape[0]} sequences; block_tables {block_tables.shape[0]}, "
            f"seq_lens {seq_lens.shape[0]}"
        )


def cpu_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's last token over its cached keys, as
    kernels/reference.py's `decode_attention_reference` defines it.

    q [num_seqs, num_heads, head_dim] (fp32 or bf16; the token at position seq_len - 1, whose
    key is already in the cache); caches [num_blocks, num_kv_heads, block_size, head_dim], fp32,
    bf16 or fp8 (float8_e4m3fn: read as float(byte) x k_scale / v_scale), contiguous;
    block_tables [num_seqs, max_blocks] int32 with at least
    ceil(seq_len / block_size) valid entries per row (unchecked: the kernel trusts them);
    seq_lens [num_seqs] int32 (0: padding, output zeros). Returns `out` (allocated when None).
    """
    if numba is None:
        raise RuntimeError("the CPU decode attention kernel needs numba (pip install numba)")
    out = torch.empty_like(q) if out is None else out
    _check_arguments(q, key_cache, value_cache, block_tables, seq_lens, out)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if q.shape[0] == 0:
        return out
    query = (q.float() * scale).contiguous()
    result = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(query)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    run_decode_kernel(
        query.numpy(), cache_array(key_cache), cache_array(value_cache), tables.numpy(),
        lens.numpy(), sliding_window, k_scale, v_scale, result.numpy(),
    )
    if result is not out:
        out.copy_(result)
    return out


def run_decode_kernel(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    sliding_window: int | None,
    k_scale: float,
    v_scale: float,
    out: np.ndarray,
) -> None:
    """The compiled kernel on arrays `cpu_decode_attention` checked and converted: query fp32,
    already scaled and contiguous; caches from `cache_array`; int32 tables and lengths; fp32
    `out`. Nothing is checked here: a caller that calls it every layer of every step (the
    torch backend) checks once and keeps the arrays (engine/attention/cpu_decode.py)."""
    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    heads = heads_per_call(query.shape[1] // num_kv_heads, head_dim)
    order = _lane_order(head_dim, key_cache.dtype == np.uint16)
    run_parallel(
        compiled_for(heads, head_dim, math.gcd(block_size, LANES)), query, key_cache,
        value_cache, block_tables, seq_lens, sliding_window or 0, np.float32(k_scale),
        np.float32(v_scale), order, out,
    )


@functools.cache
def _lane_order(head_dim: int, words: bool) -> np.ndarray:
    order = lane_order(head_dim, words)
    order.flags.writeable = False
    return order
