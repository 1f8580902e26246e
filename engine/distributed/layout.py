"""Which part of every weight and of the KV cache one tensor-parallel rank holds.

With `size` ranks, rank r holds:
  query heads      num_heads / size of them, heads [r * local, (r + 1) * local);
  KV heads         num_kv_heads / size of them when num_kv_heads >= size (sharded), else one
                   KV head, head r // (size / num_kv_heads): each KV head is replicated on the
                   size / num_kv_heads ranks whose query heads read it;
  MLP              intermediate_size / size columns of gate and up, the same rows of down;
  vocabulary       ceil(vocab_size / size) rows of the embedding and the head, from
                   r * local; the last rank's rows past vocab_size are zero padding.
q, k, v, gate and up are split by output rows (column parallel); o and down by input columns
(row parallel: partial sums, added by an all-reduce). Norms, rope and biases of row-parallel
layers are whole on every rank (a row-parallel bias is added by rank 0 alone).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    first_head: int
    first_kv_head: int
    intermediate_size: int  # this rank's
    vocab_rows: int  # rows of the embedding and head on each rank (the padded share)
    vocab_size: int  # the whole vocabulary
    total_kv_heads: int  # the model's

    @classmethod
    def for_rank(
        cls,
        rank: int,
        size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        vocab_size: int,
    ) -> ShardLayout:
        """ValueError, naming the numbers, for a model that `size` ranks cannot split."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size} tensor-parallel ranks is out of range")
        if num_heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {num_heads} attention "
                "heads (num_attention_heads)"
            )
        if intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's intermediate_size "
                f"{intermediate_size}"
            )
        if num_kv_heads >= size and num_kv_heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {num_kv_heads} KV heads "
                "(num_key_value_heads); with fewer KV heads than ranks each is replicated, which "
                "needs the rank count to be a multiple of them"
            )
        if num_kv_heads < size and size % num_kv_heads:
            raise ValueError(
                f"the model's {num_kv_heads} KV heads (num_key_value_heads) are fewer than "
                f"tensor_parallel_size {size}, which is not a multiple of them: each KV head "
                "is replicated on an equal number of ranks"
            )
        local_heads = num_heads // size
        if num_kv_heads >= size:
            local_kv_heads, first_kv_head = num_kv_heads // size, rank * (num_kv_heads // size)
        else:
            local_kv_heads, first_kv_head = 1, rank // (size // num_kv_heads)
        return cls(
            rank=rank,
            size=size,
            num_heads=local_heads,
            num_kv_heads=local_kv_heads,
            head_dim=head_dim,
            first_head=rank * local_heads,
            first_kv_head=first_kv_head,
            intermediate_size=intermediate_size // size,
            vocab_rows=-(-vocab_size // size),
            vocab_size=vocab_size,
            total_kv_heads=num_kv_heads,
        )

    @property
    def kv_replicated(self) -> bool:
        return self.total_kv_heads < self.size

    @property
    def first_vocab_row(self) -> int:
        return self.rank * self.vocab_rows

    def rows(self, kind: str) -> slice:
        """The rows of a whole HF weight this rank holds, by kind: "q", "kv", "mlp", "vocab"
        (the vocabulary slice may end past the weight: the padding)."""
        if kind == "q":
            start, count = self.first_head * self.head_dim, self.num_heads * self.head_dim
        elif kind == "kv":
            start, count = self.first_kv_head * self.head_dim, self.num_kv_heads * self.head_dim
        elif kind == "mlp":
            start, count = self.rank * self.intermediate_size, self.intermediate_size
        elif kind == "vocab":
            start, count = self.first_vocab_row, self.vocab_rows
        else:
            raise ValueError(f"unknown shard kind {kind!r}")
        return slice(start, start + count)
