"""Tensor-parallel layers: each rank holds its shard (engine/distributed/layout.py says which)
and a collective of its group (engine/distributed/group.py) makes the result whole.

  column parallel  q/k/v and gate/up: plain (fused) Linears over this rank's output rows; each
                   rank's output is its own heads' or columns' part, used as it is.
  row parallel     o and down (`RowParallelLinear`): this rank's input columns; the partial
                   products are summed by an all-reduce, so every rank has the whole output.
  vocabulary       the embedding (`VocabParallelEmbedding`) and the head hold a range of
                   vocabulary rows; a lookup outside the range gives zeros and an all-reduce
                   sums the ranks' rows; the head's logits are gathered to rank 0.

`take_shard` cuts this rank's part out of a whole HF tensor at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.distributed.group import RankGroup
from pdserve.engine.distributed.layout import ShardLayout
from pdserve.engine.layers.linear import Linear


class RowParallelLinear(Linear):
    """`in_features` is this rank's share; the bias is added by rank 0 only (`take_shard`
    gives the others zeros), so the all-reduce adds it once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: RankGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [first_row, first_row + rows) of the embedding table."""

    def __init__(
        self, layout: ShardLayout, hidden_size: int, group: RankGroup, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.first_row = layout.first_vocab_row
        self.group = group
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(hidden)


def take_shard(
    tensor: torch.Tensor, layout: ShardLayout, split: str, kind: str, param_name: str
) -> torch.Tensor:
    """This rank's part of a whole HF tensor: `split` "rows" (column parallel, and the
    vocabulary, zero-padded to its share) or "columns" (row parallel: the weight's input
    columns; the bias whole on rank 0, zeros elsewhere); `kind` as `ShardLayout.rows`."""
    if split == "rows":
        part = tensor[layout.rows(kind)]
        missing = (layout.vocab_rows if kind == "vocab" else part.shape[0]) - part.shape[0]
        if missing:
            part = torch.cat((part, part.new_zeros((missing, *part.shape[1:]))))
        return part
    if split != "columns":
        raise ValueError(f"unknown split {split!r}")
    if param_name == "bias":
        return tensor if layout.rank == 0 else torch.zeros_like(tensor)
    return tensor[:, layout.rows(kind)]
