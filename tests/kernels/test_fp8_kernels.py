"""The Triton kernels over an fp8 (float8_e4m3fn) KV cache, vLLM's semantics (stored =
fp8(clamp(x / scale)), read = float(stored) * scale): store_kv writes the reference's bytes,
saturating instead of overflowing; decode and prefill attention equal their references with the
layer's scales applied, from fp32, fp16 and bf16 queries; the block copy moves fp8 blocks
byte for byte; the triton backend equals the torch backend over an fp8 cache with scales.

Under TRITON_INTERPRET=1 (the default on a CPU) this runs the kernels in Triton's interpreter,
which converts to and from fp8 like torch; with TRITON_INTERPRET=0 on a CUDA machine the same
tests run the compiled kernels (fp8e4nv needs compute capability 8.9 or newer)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import attention_backend_class
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.kv.kv_scales import KVScales
from pdserve.kernels.block_copy import copy_blocks
from pdserve.kernels.decode_attention import SplitPlan, decode_attention
from pdserve.kernels.prefill_attention import prefill_attention
from pdserve.kernels.reference import (
    decode_attention_reference,
    prefill_attention_reference,
    store_kv_reference,
)
from pdserve.kernels.store_kv import store_kv
from tests.kernels.kernel_cases import DEVICE, TOLERANCES, KernelCase, block_tables, random_rows
from tests.kernels.test_triton_backend import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    mixed_batch,
)

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 3.0
CASES = [
    pytest.param(KernelCase(16, 64, 4, torch.float32), id="bs16-d64-g4-fp32"),
    pytest.param(KernelCase(8, 80, 1, torch.float16), id="bs8-d80-g1-fp16"),
    pytest.param(KernelCase(32, 128, 8, torch.bfloat16), id="bs32-d128-g8-bf16"),
]


def fp8_cache(case: KernelCase, num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache): layer 1 of a random two-layer fp8 buffer."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 2, num_blocks, case.num_kv_heads, case.block_size, case.head_dim)
    buffer = torch.randn(shape, generator=generator).to(FP8).to(DEVICE)
    return buffer[1, 0], buffer[1, 1]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernel tests' tolerance for `dtype`, its absolute part grown with the values' scale
    (outputs are weighted sums of values up to a few times V_SCALE)."""
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.float().cpu(),
        expected.float().cpu(),
        atol=tolerance["atol"] * V_SCALE,
        rtol=tolerance["rtol"],
    )


@pytest.mark.parametrize("case", CASES)
def test_store_kv_writes_the_scaled_fp8_bytes_of_the_reference(case):
    key_cache, value_cache = fp8_cache(case, 6, seed=1)
    key = random_rows(13, case.num_kv_heads, case, seed=2) * 100  # some past 448 x scale
    value = random_rows(13, case.num_kv_heads, case, seed=3) * 100
    slots = torch.randperm(6 * case.block_size, generator=torch.Generator().manual_seed(4))[:13]
    slots[::4] = -1
    slots = slots.to(DEVICE)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    store_kv_reference(key, value, expected_keys, expected_values, slots, K_SCALE, V_SCALE)

    store_kv(key, value, key_cache, value_cache, slots, K_SCALE, V_SCALE)

    assert torch.equal(as_bytes(key_cache), as_bytes(expected_keys))
    assert torch.equal(as_bytes(value_cache), as_bytes(expected_values))
    written = slots >= 0
    stored = key_cache[slots[written] // case.block_size, :, slots[written] % case.block_size]
    assert stored.float().isfinite().all(), "values past the fp8 range must saturate, not NaN"
    assert stored.float().abs().max() == 448.0
    roundtrip = stored.float() * K_SCALE
    inside = key[written].float().abs() < 400 * K_SCALE
    torch.testing.assert_close(  # e4m3 keeps 3 mantissa bits: within 1/16 relative
        roundtrip[inside], key[written].float()[inside], rtol=1 / 16, atol=2**-9 * K_SCALE
    )


def test_store_kv_rounds_every_magnitude_and_sign_as_torchs_cast():
    """From far below the subnormals (which round to a signed zero: -0.0 for a negative x, as
    torch's cast gives; the compiled kernel once stored +0.0) to past the range (saturated)."""
    case = KernelCase(16, 64, 1, torch.float32)
    key_cache, value_cache = fp8_cache(case, 8, seed=5)
    generator = torch.Generator().manual_seed(6)
    rows = 8 * case.block_size
    magnitude = 10 ** (torch.rand(rows, case.num_kv_heads, case.head_dim, generator=generator) * 8 - 5)
    sign = torch.randint(0, 2, magnitude.shape, generator=generator) * 2 - 1
    key = (magnitude * sign).to(DEVICE)
    slots = torch.randperm(rows, generator=generator).to(DEVICE)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    store_kv_reference(key, -key, expected_keys, expected_values, slots, K_SCALE, V_SCALE)

    store_kv(key, -key, key_cache, value_cache, slots, K_SCALE, V_SCALE)

    assert torch.equal(as_bytes(key_cache), as_bytes(expected_keys))
    assert torch.equal(as_bytes(value_cache), as_bytes(expected_values))
    assert (as_bytes(expected_keys) == 0x80).any(), "some negative x must round to -0.0"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sliding_window", [None, 20], ids=["full", "window20"])
def test_decode_attention_reads_fp8_times_the_scales(case, sliding_window):
    key_cache, value_cache = fp8_cache(case, 40, seed=5)
    seq_lens = [0, 1, case.block_size + 1, 71]
    tables = block_tables(seq_lens, case.block_size, 40, seed=6)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(len(seq_lens), case.num_heads, case, seed=7)
    scale = case.head_dim**-0.5
    plan = SplitPlan(num_splits=3, tokens_per_split=32, tile=16)
    expected = decode_attention_reference(
        q, key_cache, value_cache, tables, lens, scale, sliding_window, None, K_SCALE, V_SCALE
    )
    unscaled = decode_attention_reference(q, key_cache, value_cache, tables, lens, scale)

    out = decode_attention(
        q,
        key_cache,
        value_cache,
        tables,
        lens,
        scale,
        sliding_window,
        plan=plan,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )

    assert out.dtype == case.dtype
    assert_close_scaled(out, expected, case.dtype)
    assert not torch.allclose(out.float(), unscaled.float(), atol=0.1)


@pytest.mark.parametrize("case", CASES)
def test_prefill_attention_reads_fp8_times_the_scales(case):
    spans = [(0, 37), (5, 12), (32, 20)]
    seq_lens = [context + new for context, new in spans]
    key_cache, value_cache = fp8_cache(case, 40, seed=8)
    tables = block_tables(seq_lens, case.block_size, 40, seed=9)
    offsets = [0]
    for _, new in spans:
        offsets.append(offsets[-1] + new)
    query_start = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = random_rows(offsets[-1], case.num_heads, case, seed=10)
    scale = case.head_dim**-0.5
    expected = prefill_attention_reference(
        q, key_cache, value_cache, tables, query_start, lens, scale, None, None, K_SCALE, V_SCALE
    )

    out = prefill_attention(
        q,
        key_cache,
        value_cache,
        tables,
        query_start,
        lens,
        37,
        scale,
        block_m=16,
        block_n=16,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )

    assert_close_scaled(out, expected, case.dtype)


def test_block_copy_moves_fp8_blocks_byte_for_byte():
    generator = torch.Generator().manual_seed(11)
    buffer = torch.randn(3, 2, 9, 2, 16, 64, generator=generator).to(FP8).to(DEVICE)
    before = buffer.clone()
    ids = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in ((1, 4), (7, 0))]

    copy_blocks(buffer, *ids)

    assert torch.equal(as_bytes(buffer[:, :, 7]), as_bytes(before[:, :, 1]))
    assert torch.equal(as_bytes(buffer[:, :, 0]), as_bytes(before[:, :, 4]))
    assert torch.equal(as_bytes(buffer[:, :, 2:7]), as_bytes(before[:, :, 2:7]))


def test_kernels_refuse_queries_in_fp8_and_bad_scales():
    case = KernelCase(16, 64, 1, torch.float32)
    key_cache, value_cache = fp8_cache(case, 4, seed=12)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    q = random_rows(1, case.num_heads, case, seed=13)
    with pytest.raises(ValueError, match="over an fp8 cache"):
        decode_attention(q.to(FP8), key_cache, value_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="k_scale must be positive"):
        decode_attention(q, key_cache, value_cache, tables, lens, 0.125, k_scale=0.0)


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_triton_backend_matches_torch_backend_over_an_fp8_cache(sliding_window):
    batch = mixed_batch()
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(batch.num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
    q, k, v = qkv.to(DEVICE).split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    scales = KVScales((1.0, 0.25), (1.0, 2.0))
    outputs, caches = [], []
    for backend_class in (TorchAttentionBackend, attention_backend_class("triton")):
        spec = KVCacheSpec(2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, FP8)
        cache = KVCache(spec, num_blocks=24, device=DEVICE)
        cache.buffer.copy_(
            torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(2))
        )
        backend = backend_class(cache, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, sliding_window, scales)
        outputs.append(backend.forward(1, q, k, v, backend.prepare(batch)))
        caches.append(cache.buffer)

    torch.testing.assert_close(outputs[1], outputs[0], **TOLERANCES[torch.float32])
    assert torch.equal(as_bytes(caches[1]), as_bytes(caches[0]))
