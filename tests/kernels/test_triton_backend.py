"""The triton attention backend gives the torch backend's outputs and cache contents on mixed
flat batches (decodes, a whole prompt, an extend after a cached prefix), with and without a
sliding window, and is chosen by name."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import attention_backend_class
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.batch import build_flat_batch
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.runner.cuda_graphs import decode_buckets
from tests.kernels.kernel_cases import DEVICE, TOLERANCES

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16


def filled_cache(seed: int) -> KVCache:
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
        dtype=torch.float32,
    )
    cache = KVCache(spec, num_blocks=24, device=DEVICE)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def mixed_batch():
    """Three decodes (contexts 0, 16, 40), a 20-token prompt, a 9-token extend after 35."""
    context_lens = [0, 16, 40, 0, 35]
    new_tokens = [1, 1, 1, 20, 9]
    tables = [[3], [5, 7], [1, 9, 11], [2, 4], [6, 8, 10]]
    return build_flat_batch(
        token_chunks=[[1] * n for n in new_tokens],
        context_lens=context_lens,
        block_tables=tables,
        sample_flags=[True] * 5,
        block_size=BLOCK_SIZE,
        device=DEVICE,
    )


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(sliding_window):
    triton_class = attention_backend_class("triton")
    batch = mixed_batch()
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(batch.num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
    q, k, v = qkv.to(DEVICE).split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    outputs, caches = [], []
    for backend_class in (TorchAttentionBackend, triton_class):
        cache = filled_cache(seed=2)
        backend = backend_class(cache, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, sliding_window)
        metadata = backend.prepare(batch)
        outputs.append(backend.forward(1, q, k, v, metadata))
        caches.append(cache.buffer)

    torch.testing.assert_close(outputs[1], outputs[0], **TOLERANCES[torch.float32])
    assert torch.equal(caches[1], caches[0])


def test_triton_backend_is_registered_and_cuda_graphs_need_it():
    assert attention_backend_class("triton").__name__ == "TritonAttentionBackend"
    with pytest.raises(ValueError, match="valid: torch, triton"):
        EngineConfig(attention_backend="cuda")
    with pytest.raises(ValueError, match="cuda_graphs needs"):
        EngineConfig(attention_backend="torch", cuda_graphs=True)
    assert EngineConfig(attention_backend="triton", cuda_graphs=True).cuda_graphs


def test_cuda_graph_buckets_cover_every_batch_size_up_to_the_largest():
    assert decode_buckets(1) == [1]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = decode_buckets(256)
    assert all(any(b >= n for b in buckets) for n in range(1, 257))
    assert decode_buckets(4096)[-1] == 512


def test_cuda_graphs_are_off_on_the_cpu(tiny_llama_dir):
    from pdserve.engine import LLM

    llm = LLM(str(tiny_llama_dir), attention_backend="triton", cuda_graphs=True, device="cpu")
    assert llm.engine.runner.decode_graphs is None
