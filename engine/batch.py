"""The flat batch: one token stream for prefill chunks, decodes and mixed steps, no padding.

Sequence i owns tokens `query_start[i]:query_start[i+1]` of the stream; they sit at positions
`context_lens[i] .. seq_lens[i]-1` of that sequence, whose KV lives in the blocks of
`block_tables[i]`. `logits_indices` selects the stream positions whose next token is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlatBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def query_len(self, i: int) -> int:
        return self.query_start[i + 1] - self.query_start[i]


def build_flat_batch(
    token_chunks: list[list[int]],
    context_lens: list[int],
    block_tables: list[list[int]],
    sample_flags: list[bool],
    block_size: int,
    device: torch.device,
) -> FlatBatch:
    """token_chunks[i] are sequence i's new tokens, starting at position context_lens[i]."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens = []
    logits_indices = []
    for chunk, context_len, table, sample in zip(
        token_chunks, context_lens, block_tables, sample_flags
    ):
        seq_len = context_len + len(chunk)
        input_ids.extend(chunk)
        seq_positions = range(context_len, seq_len)
        positions.extend(seq_positions)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in seq_positions)
        query_start.append(len(input_ids))
        seq_lens.append(seq_len)
        if sample:
            logits_indices.append(len(input_ids) - 1)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return FlatBatch(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        logits_indices=as_tensor(logits_indices),
        query_start=query_start,
        context_lens=list(context_lens),
        seq_lens=seq_lens,
        block_tables=block_tables,
    )
