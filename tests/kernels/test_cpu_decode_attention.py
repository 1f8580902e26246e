"""The CPU decode attention kernel (numba) equals the pure-torch reference within fp32
tolerance: shuffled, non-contiguous block tables, lengths of 0, 1, a block, a block + 1 and
long, GQA groups of 1 to 8 query heads per KV head, head dims 48 to 256, block sizes 5 to 64,
with and without a sliding window, over fp32 and bf16 caches (NaN in a block's unwritten slots
harmless), and over fp8 (e4m3) caches read times their key
and value scales. The torch backend's decode with the kernel equals its gather path on a mixed
batch (fp32 and fp8 with scales), and falls back to that path when numba is missing."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.batch import build_flat_batch
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.kv.kv_scales import KVScales
from pdserve.kernels import cpu_decode_attention as kernel_module
from pdserve.kernels.cpu_decode_attention import cpu_decode_attention
from pdserve.kernels.reference import decode_attention_reference

needs_numba = pytest.mark.skipif(kernel_module.numba is None, reason="numba is not installed")
BLOCK_SIZE = 16
FP32 = {"atol": 1e-5, "rtol": 1e-5}
LENGTHS = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 0, 3 * BLOCK_SIZE - 1, 300, 2]


def paged_case(seq_lens, num_kv_heads, group, head_dim, dtype, seed=0, block_size=BLOCK_SIZE):
    """(q, key_cache, value_cache, block_tables, seq_lens): caches are layer 1 of a two-layer
    buffer, every sequence's blocks drawn at random from a shuffled pool (padded with 0)."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + 5
    shape = (2, 2, num_blocks, num_kv_heads, block_size, head_dim)
    buffer = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width, rows, used = max(counts), [], 0
    for count in counts:
        rows.append(order[used : used + count] + [0] * (width - count))
        used += count
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=generator)
    tables = torch.tensor(rows, dtype=torch.int32)
    return q.to(dtype), buffer[1, 0], buffer[1, 1], tables, torch.tensor(seq_lens).int()


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize(
    "num_kv_heads, group, head_dim", [(3, 3, 64), (2, 1, 128), (1, 8, 64), (2, 8, 128)]
)
def test_kernel_equals_reference(num_kv_heads, group, head_dim, sliding_window, dtype):
    q, key_cache, value_cache, tables, lens = paged_case(
        LENGTHS, num_kv_heads, group, head_dim, dtype
    )
    scale = head_dim**-0.5
    out = torch.full(q.shape, 7.0)  # fp32 out: compared at fp32 tolerance whatever the cache

    cpu_decode_attention(q, key_cache, value_cache, tables, lens, scale, sliding_window, out)

    expected = decode_attention_reference(
        q.float(), key_cache.float(), value_cache.float(), tables, lens, scale, sliding_window
    )
    torch.testing.assert_close(out, expected, **FP32)
    assert not out[LENGTHS.index(0)].any(), "a sequence of length 0 attends to nothing"


@needs_numba
@pytest.mark.parametrize("sliding_window", [None, 20], ids=["full", "window20"])
def test_kernel_reads_an_fp8_cache_times_its_scales(sliding_window):
    q, key_cache, value_cache, tables, lens = paged_case(LENGTHS, 2, 3, 64, torch.float32)
    key_cache, value_cache = (c.to(torch.float8_e4m3fn) for c in (key_cache, value_cache))
    out = torch.full(q.shape, 7.0)

    cpu_decode_attention(
        q, key_cache, value_cache, tables, lens, 0.125, sliding_window, out, 0.5, 3.0
    )

    expected = decode_attention_reference(
        q, key_cache, value_cache, tables, lens, 0.125, sliding_window, k_scale=0.5, v_scale=3.0
    )
    unscaled = decode_attention_reference(
        q, key_cache, value_cache, tables, lens, 0.125, sliding_window
    )
    torch.testing.assert_close(out, expected, **FP32)
    assert not torch.allclose(out, unscaled, atol=1e-2), "the scales were not applied"


@needs_numba
def test_kernel_widens_every_fp8_code_exactly_subnormals_included():
    """Values hold every non-NaN e4m3 byte (subnormals, zeros of both signs, +-448) and keys
    are small, so every value weighs in the output; the kernel widens bytes by bit arithmetic."""
    q, key_cache, value_cache, tables, lens = paged_case([300, 77], 1, 2, 64, torch.float32)
    key_cache = (key_cache * 0.1).to(torch.float8_e4m3fn)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    picks = torch.randint(len(codes), value_cache.shape, generator=torch.Generator().manual_seed(1))
    value_cache = codes[picks].view(torch.float8_e4m3fn)
    assert value_cache.float().isfinite().all()

    out = cpu_decode_attention(
        q, key_cache, value_cache, tables, lens, 0.125, k_scale=1.5, v_scale=0.75
    )

    expected = decode_attention_reference(
        q, key_cache, value_cache, tables, lens, 0.125, k_scale=1.5, v_scale=0.75
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    for code, value in ((0x01, 2.0**-9), (0x83, -3 * 2.0**-9), (0x08, 2.0**-6), (0x7E, 448.0)):
        same = torch.full(value_cache.shape, code, dtype=torch.uint8).view(torch.float8_e4m3fn)
        out = cpu_decode_attention(q, key_cache, same, tables, lens, 0.125, v_scale=0.75)
        torch.testing.assert_close(out, torch.full_like(out, value * 0.75), atol=0, rtol=1e-5)


@needs_numba
def test_kernel_writes_the_query_dtype_when_no_out_is_given():
    q, key_cache, value_cache, tables, lens = paged_case([40, 7], 2, 4, 64, torch.bfloat16)

    out = cpu_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)

    expected = decode_attention_reference(
        q.float(), key_cache.float(), value_cache.float(), tables, lens, 0.125
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_numba
def test_kernel_rejects_mismatched_arguments():
    q, key_cache, value_cache, tables, lens = paged_case([5], 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of 2 heads"):
        cpu_decode_attention(q[:, :3], key_cache, value_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="share one dtype"):
        cpu_decode_attention(q, key_cache, value_cache.half(), tables, lens, 0.125)
    with pytest.raises(ValueError, match="block_tables 2"):
        cpu_decode_attention(q, key_cache, value_cache, tables.repeat(2, 1), lens, 0.125)


def mixed_step_outputs(backend: TorchAttentionBackend, seed: int) -> torch.Tensor:
    """One layer of a step with four decodes (lengths 1, 16, 17, 200; shuffled blocks) and a
    prefill chunk after cached context; returns the attention output of every token."""
    generator = torch.Generator().manual_seed(seed)
    spec = backend.kv_cache.spec
    backend.kv_cache.buffer.copy_(torch.randn(backend.kv_cache.buffer.shape, generator=generator))
    order = torch.randperm(backend.kv_cache.num_blocks, generator=generator).tolist()
    context_lens, chunks = [0, 15, 16, 199, 40], [[1], [1], [1], [1], [1] * 9]
    tables, used = [], 0
    for context_len, chunk in zip(context_lens, chunks):
        count = -(-(context_len + len(chunk)) // spec.block_size)
        tables.append(order[used : used + count])
        used += count
    batch = build_flat_batch(
        chunks, context_lens, tables, [True] * len(chunks), spec.block_size, torch.device("cpu")
    )
    heads, kv_heads, dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    tokens = batch.num_tokens
    q = torch.randn(tokens, heads, dim, generator=generator)
    k = torch.randn(tokens, kv_heads, dim, generator=generator)
    v = torch.randn(tokens, kv_heads, dim, generator=generator)
    return backend.forward(0, q, k, v, backend.prepare(batch))


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "block_size, num_kv_heads, group, head_dim, sliding_window",
    [
        (8, 2, 7, 80, None),  # half-block chunks; one head per call; 80 = 2 x 32 + 16 in bf16
        (32, 1, 4, 96, 40),  # two chunks per block, a window starting inside either
        (5, 2, 2, 48, 9),  # one-token chunks
        (64, 1, 2, 256, None),  # a head's accumulators fill the registers
    ],
)
def test_kernel_equals_reference_for_other_block_sizes_head_dims_and_groups(
    block_size, num_kv_heads, group, head_dim, sliding_window, dtype
):
    lengths = [1, block_size, block_size + 1, 0, 3 * block_size - 1, 300, 2, 17]
    q, key_cache, value_cache, tables, lens = paged_case(
        lengths, num_kv_heads, group, head_dim, dtype, block_size=block_size
    )
    scale = head_dim**-0.5
    out = torch.full(q.shape, 7.0)

    cpu_decode_attention(q, key_cache, value_cache, tables, lens, scale, sliding_window, out)

    expected = decode_attention_reference(
        q.float(), key_cache.float(), value_cache.float(), tables, lens, scale, sliding_window
    )
    torch.testing.assert_close(out, expected, **FP32)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_in_the_unwritten_slots_of_a_block_does_not_reach_the_output(dtype):
    lengths = [1, BLOCK_SIZE + 3, 40]
    q, key_cache, value_cache, tables, lens = paged_case(lengths, 2, 3, 64, dtype)
    expected = decode_attention_reference(
        q.float(), key_cache.float(), value_cache.float(), tables, lens, 0.125, None
    )
    for row, length in zip(tables.tolist(), lengths):  # past each sequence's end: NaN
        last_block, used = row[(length - 1) // BLOCK_SIZE], (length - 1) % BLOCK_SIZE + 1
        key_cache[last_block, :, used:] = float("nan")
        value_cache[last_block, :, used:] = float("nan")

    out = cpu_decode_attention(q.float(), key_cache, value_cache, tables, lens, 0.125)

    torch.testing.assert_close(out, expected, **FP32)


def test_heads_per_call_fills_the_registers_with_a_divisor_of_the_group():
    assert kernel_module.heads_per_call(3, 64) == 3  # 12 accumulator vectors
    assert kernel_module.heads_per_call(8, 64) == 4  # 16
    assert kernel_module.heads_per_call(8, 128) == 2
    assert kernel_module.heads_per_call(7, 64) == 1  # 7 is prime and 28 vectors do not fit
    assert kernel_module.heads_per_call(4, 512) == 1  # one head always


def test_backend_keeps_the_gather_path_for_a_head_dim_off_the_vector_width():
    spec = KVCacheSpec(1, 2, 72, BLOCK_SIZE, torch.float32)
    backend = TorchAttentionBackend(KVCache(spec, 40, torch.device("cpu")), 4, 2, 72, None)
    assert backend.cpu_decode is None
    assert mixed_step_outputs(backend, 2).isfinite().all()


@needs_numba
@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8-scaled"]
)
@pytest.mark.parametrize("sliding_window", [None, 24], ids=["full", "window24"])
def test_backend_decode_with_the_kernel_equals_its_gather_path(sliding_window, cache_dtype):
    spec = KVCacheSpec(1, 3, 64, BLOCK_SIZE, cache_dtype)
    scales = KVScales((0.25,), (2.0,)) if cache_dtype != torch.float32 else None

    def backend() -> TorchAttentionBackend:
        cache = KVCache(spec, 40, torch.device("cpu"))
        return TorchAttentionBackend(cache, 9, 3, 64, sliding_window, scales)

    fused, gather = backend(), backend()
    gather.cpu_decode = None
    assert fused.cpu_decode is not None

    torch.testing.assert_close(mixed_step_outputs(fused, 1), mixed_step_outputs(gather, 1), **FP32)


def test_backend_falls_back_to_the_gather_path_without_numba(monkeypatch):
    monkeypatch.setattr(kernel_module, "numba", None)
    spec = KVCacheSpec(1, 2, 64, BLOCK_SIZE, torch.float32)
    backend = TorchAttentionBackend(KVCache(spec, 40, torch.device("cpu")), 4, 2, 64, None)

    assert backend.cpu_decode is None
    assert mixed_step_outputs(backend, 2).isfinite().all()


def test_backend_keeps_the_gather_path_for_an_fp16_cache():
    spec = KVCacheSpec(1, 2, 64, BLOCK_SIZE, torch.float16)
    backend = TorchAttentionBackend(KVCache(spec, 4, torch.device("cpu")), 4, 2, 64, None)
    assert backend.cpu_decode is None


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backends_kernel_keeps_each_layers_arrays_and_still_equals_the_checked_call(dtype):
    from pdserve.engine.attention.cpu_decode import CpuDecodeKernel, PagedDecode

    kernel = CpuDecodeKernel(BLOCK_SIZE, 0.125, None)
    q, key_cache, value_cache, tables, lens = paged_case(LENGTHS, 2, 3, 64, dtype)
    decode = PagedDecode(len(lens), tables, lens)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):  # the first call checks; later ones read through its arrays
        key_cache.copy_(torch.randn(key_cache.shape, generator=generator))  # the KV of a step
        q = torch.randn(q.shape, generator=generator).to(dtype)
        expected = cpu_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
        out = torch.empty_like(expected)
        kernel.attend(1, q, key_cache, value_cache, decode, out)
        assert torch.equal(out, expected), step
        assert kernel._cache_arrays[1][0] == key_cache.data_ptr()
    # Another buffer for the layer is checked again, not read through the kept arrays.
    q, key_cache, value_cache, tables, lens = paged_case(LENGTHS, 2, 3, 64, dtype, seed=9)
    with pytest.raises(ValueError, match="q must be"):
        kernel.attend(
            1, q[:, :5], key_cache, value_cache, PagedDecode(len(lens), tables, lens),
            torch.empty_like(q[:, :5]),
        )
