"""CUDA graphs for pure-decode steps: one graph per batch-size bucket, captured at start-up.

A decode step launches a few hundred small kernels; at small batch the launches, not memory
traffic, bound the step. A captured graph replays the whole model forward as one launch.

A graph fixes tensor addresses and shapes at capture, so every input of the forward lives in a
buffer owned here, sized for the largest bucket: token ids, positions, slots, sequence lengths
and block tables wide enough for `max_model_len`. A step of n decode sequences replays the
smallest bucket B >= n: rows 0..n-1 get the step's values and rows n..B-1 are padding (slot -1:
nothing is stored; length 0: attention writes zeros; their logits are dropped). The decode
split plan comes from `max_model_len`, not from the step, so it is fixed at capture.

Steps with a prefill chunk, or more sequences than the largest bucket, run eagerly. The sampler
runs outside the graph, on the logits the graph leaves in its output buffer; that buffer is
overwritten by the next replay.

Memory: the graphs share one private pool. The largest bucket is captured first, so the smaller
ones reuse the activations' memory it reserved; each graph keeps its own logits buffer. The
model runner reserves that much before it sizes the KV cache (engine/runner/memory_profile.py), and
`memory_bytes` is what capture really took, for the log.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata
from pdserve.engine.batch import FlatBatch

LARGEST_BUCKET = 512


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (itself included)."""
    largest = min(max_num_seqs, LARGEST_BUCKET)
    sizes = {s for s in (1, 2, 4, 8) if s < largest} | set(range(16, largest, 16)) | {largest}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: TritonAttentionBackend,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if device.type != "cuda" or not isinstance(backend, TritonAttentionBackend):
            raise ValueError("CUDA graphs need a CUDA device and the triton attention backend")
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_num_seqs)
        largest = self.buckets[-1]
        with torch.inference_mode():
            self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
            self.positions = torch.zeros(largest, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
            self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(
                largest, -(-max_model_len // block_size), dtype=torch.int32, device=device
            )
            self.logits_indices = torch.arange(largest, dtype=torch.long, device=device)
            self.pool = torch.cuda.graph_pool_handle()
            self.warm_up_stream = torch.cuda.Stream(device)
            self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            reserved_before = torch.cuda.memory_reserved(device)
            # Largest first: the smaller graphs then fit in the memory its capture reserved.
            for size in reversed(self.buckets):
                self.graphs[size] = self._capture(size)
            # The warm-up runs' blocks are cached for their stream, where no step will reuse
            # them: give them back to the device (the graphs' pool stays).
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            self.memory_bytes = max(torch.cuda.memory_reserved(device) - reserved_before, 0)

    def _forward(self, size: int, metadata: TritonAttentionMetadata) -> torch.Tensor:
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.logits_indices[:size],
            self.backend,
            metadata,
        )

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        metadata = TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            decode=self.backend.decode_metadata(
                self.block_tables[:size], self.seq_lens[:size], self.max_model_len
            ),
            prefill=None,
        )
        # A warm-up run on a side stream compiles the kernels and settles the allocator, which
        # must not happen during capture. Every row is padding here: nothing is written.
        side = self.warm_up_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(size, metadata)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size, metadata)
        return graph, logits

    def can_run(self, batch: FlatBatch) -> bool:
        """A pure-decode step (one new token per sequence, each sampled) that fits a bucket."""
        return (
            0 < batch.num_seqs <= self.buckets[-1]
            and batch.num_tokens == batch.num_seqs
            and batch.logits_indices.numel() == batch.num_seqs
            and max(batch.seq_lens) <= self.max_model_len
        )

    def run(self, batch: FlatBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab] of the step (a view of the graph's output buffer)."""
        count = batch.num_seqs
        size = next(s for s in self.buckets if s >= count)
        block_size = self.backend.kv_cache.spec.block_size
        used_blocks = [-(-n // block_size) for n in batch.seq_lens]
        width = max(used_blocks)
        tables = [t[:c] + [0] * (width - c) for t, c in zip(batch.block_tables, used_blocks)]

        self.input_ids[:count].copy_(batch.input_ids)
        self.positions[:count].copy_(batch.positions)
        self.slot_mapping[:count].copy_(batch.slot_mapping)
        self.slot_mapping[count:size].fill_(-1)
        self.seq_lens[:count].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        self.seq_lens[count:size].fill_(0)
        self.block_tables[:count, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:count]
