"""The torch backend's decode on the CPU: kernels/cpu_decode_attention.py's compiled kernel,
which reads every decoding sequence's blocks in place through its block table.

`CpuDecodeKernel.for_cache` returns None where that kernel cannot run (not a CPU cache, a
dtype other than fp32, bf16 or fp8 e4m3, a head dim that is not a multiple of 16, numba not
installed), and the backend keeps its gather path
(`TorchAttentionBackend._decode`), which is also the kernel's reference in the tests. Built
once per backend; it compiles the kernel for the cache's dtype right away (or loads numba's
on-disk cache: a fraction of a second), so no decode step pays the compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.batch import FlatBatch
from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.kv.kv_scales import KVScales, is_fp8


@dataclass
class PagedDecode:
    """The decoding sequences of a step (the first `num_seqs` of the batch), shared by every
    layer: int32 block tables padded with block 0, and int32 lengths (their numpy views are
    what every layer's kernel call takes)."""

    num_seqs: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def __post_init__(self) -> None:
        self.block_table_array = self.block_tables.numpy()
        self.seq_len_array = self.seq_lens.numpy()


class CpuDecodeKernel:
    def __init__(
        self,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        kv_scales: KVScales | None = None,
    ) -> None:
        from pdserve.kernels import cpu_decode_attention as kernel

        self.block_size = block_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_scales = kv_scales
        self._kernel = kernel
        # Per layer: its caches' data pointers and the arrays the kernel reads them through,
        # made on the layer's first call, which runs the kernel's full argument checks.
        self._cache_arrays: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    @classmethod
    def for_cache(
        cls,
        kv_cache: KVCache,
        num_heads: int,
        scale: float,
        sliding_window: int | None,
        kv_scales: KVScales | None = None,
    ) -> CpuDecodeKernel | None:
        """The kernel for this cache, compiled; None where it cannot run."""
        spec = kv_cache.spec
        if kv_cache.buffer.device.type != "cpu":
            return None
        from pdserve.kernels.cpu_decode_attention import cpu_decode_attention_available

        if not cpu_decode_attention_available(spec.dtype, spec.head_dim):
            return None
        kernel = cls(spec.block_size, scale, sliding_window, kv_scales)
        kernel.compile(kv_cache, num_heads)
        return kernel

    def compile(self, kv_cache: KVCache, num_heads: int) -> None:
        """One call on a single-token sequence in block 0 (its output is thrown away)."""
        key_cache, value_cache = kv_cache.key_cache(0), kv_cache.value_cache(0)
        dtype = torch.float32 if is_fp8(kv_cache.spec.dtype) else kv_cache.spec.dtype
        q = torch.zeros(1, num_heads, kv_cache.spec.head_dim, dtype=dtype)
        one = torch.ones(1, 1, dtype=torch.int32)
        decode = PagedDecode(1, one - 1, one[0])
        self.attend(0, q, key_cache, value_cache, decode, torch.empty_like(q))

    def prepare(self, batch: FlatBatch, num_decodes: int) -> PagedDecode:
        seq_lens = batch.seq_lens[:num_decodes]
        counts = [-(-n // self.block_size) for n in seq_lens]
        width = max(counts)
        rows = [
            batch.block_tables[i][:count] + [0] * (width - count)
            for i, count in enumerate(counts)
        ]
        return PagedDecode(
            num_seqs=num_decodes,
            block_tables=torch.tensor(rows, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        decode: PagedDecode,
        out: torch.Tensor,
    ) -> None:
        """Writes the decoding sequences' attention into `out`. The first call per layer goes
        through `cpu_decode_attention` (every argument checked); later ones call the kernel on
        the arrays kept from it, since a layer's caches and the step's shapes cannot change
        (about 30 us less per call, a millisecond per batch-1 step of a 30-layer model)."""
        kernel = self._kernel
        k_scale = self.kv_scales.k[layer] if self.kv_scales else 1.0
        v_scale = self.kv_scales.v[layer] if self.kv_scales else 1.0
        kept = self._cache_arrays.get(layer)
        if kept is None or kept[0] != key_cache.data_ptr():
            kernel.cpu_decode_attention(
                q, key_cache, value_cache, decode.block_tables, decode.seq_lens, self.scale,
                self.sliding_window, out, k_scale, v_scale,
            )
            self._cache_arrays[layer] = (
                key_cache.data_ptr(),
                kernel.cache_array(key_cache),
                kernel.cache_array(value_cache),
            )
            return
        query = (q.float() * self.scale).contiguous()
        result = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(query)
        kernel.run_decode_kernel(
            query.numpy(), kept[1], kept[2], decode.block_table_array, decode.seq_len_array,
            self.sliding_window, k_scale, v_scale, result.numpy(),
        )
        if result is not out:
            out.copy_(result)
