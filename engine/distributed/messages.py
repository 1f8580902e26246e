"""What rank 0 sends each worker rank, in order, over the worker's stdin pipe.

  StepInputs  one step: the copy-on-write block copies, then the flat batch the model runs
              (engine/batch.py) and the rows whose logits are wanted. The worker copies the
              blocks in its own KV shard, runs its shard of the forward (whose collectives
              meet rank 0's) and drops its (empty) result.
  BlockSwap   a swap-out (device blocks -> host blocks) or swap-in (host -> device) of
              preempted KV, with the host block ids rank 0's scheduler chose: each rank
              swaps its own shard between its KV cache and its own host buffer.
The pipe's end (EOF) tells a worker to exit.

A message is one frame: its byte length (8 bytes, little-endian), then int64 values: a tag,
the number of arrays, each array's length, then the arrays. Nothing executable travels, and
`decode` checks the tag and every length before anything acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from pdserve.engine.batch import FlatBatch

_STEP, _SWAP_OUT, _SWAP_IN = 1, 2, 3
_LENGTH_BYTES = 8
MAX_FRAME_BYTES = 1 << 30


@dataclass
class StepInputs:
    blocks_to_copy: list[tuple[int, int]]
    batch: FlatBatch
    logits_indices: torch.Tensor


@dataclass
class BlockSwap:
    to_host: bool
    pairs: list[tuple[int, int]]  # (source block, destination block)


Message = StepInputs | BlockSwap


def _pairs_arrays(pairs: list[tuple[int, int]]) -> list[np.ndarray]:
    return [np.array([p[i] for p in pairs], dtype=np.int64) for i in (0, 1)]


def encode(message: Message) -> bytes:
    if isinstance(message, BlockSwap):
        tag, arrays = (_SWAP_OUT if message.to_host else _SWAP_IN), _pairs_arrays(message.pairs)
    else:
        batch = message.batch
        tables = batch.block_tables
        arrays = [
            *_pairs_arrays(message.blocks_to_copy),
            *(
                t.cpu().numpy().astype(np.int64)
                for t in (
                    batch.input_ids,
                    batch.positions,
                    batch.slot_mapping,
                    message.logits_indices,
                )
            ),
            *(
                np.array(values, dtype=np.int64)
                for values in (
                    batch.query_start,
                    batch.context_lens,
                    batch.seq_lens,
                    [len(t) for t in tables],
                    [b for t in tables for b in t],
                )
            ),
        ]
        tag = _STEP
    header = np.array([tag, len(arrays), *(a.size for a in arrays)], dtype=np.int64)
    payload = np.concatenate([header, *arrays]).tobytes()
    return len(payload).to_bytes(_LENGTH_BYTES, "little") + payload


def decode(payload: bytes, device: torch.device) -> Message:
    """ValueError for a frame that is not a well-formed message."""
    if len(payload) % 8 or len(payload) < 16:
        raise ValueError(f"a worker message of {len(payload)} bytes is malformed")
    values = np.frombuffer(payload, dtype=np.int64)
    tag, count = int(values[0]), int(values[1])
    expected = {_STEP: 11, _SWAP_OUT: 2, _SWAP_IN: 2}.get(tag)
    if expected is None or count != expected or values.size < 2 + count:
        raise ValueError(f"a worker message with tag {tag} and {count} arrays is malformed")
    lengths = values[2 : 2 + count]
    if (lengths < 0).any() or 2 + count + int(lengths.sum()) != values.size:
        raise ValueError("a worker message's array lengths do not add up to its size")
    arrays, start = [], 2 + count
    for length in lengths.tolist():
        arrays.append(values[start : start + length])
        start += length
    pairs = list(zip(arrays[0].tolist(), arrays[1].tolist()))
    if tag != _STEP:
        return BlockSwap(to_host=tag == _SWAP_OUT, pairs=pairs)
    input_ids, positions, slot_mapping, logits_indices = (
        torch.from_numpy(a.copy()).to(device) for a in arrays[2:6]
    )
    query_start, context_lens, seq_lens, table_lengths, flat_tables = (
        a.tolist() for a in arrays[6:]
    )
    if sum(table_lengths) != len(flat_tables) or len(table_lengths) != len(seq_lens):
        raise ValueError("a worker message's block tables do not match its sequences")
    tables, start = [], 0
    for length in table_lengths:
        tables.append(flat_tables[start : start + length])
        start += length
    batch = FlatBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        query_start=query_start,
        context_lens=context_lens,
        seq_lens=seq_lens,
        block_tables=tables,
    )
    return StepInputs(blocks_to_copy=pairs, batch=batch, logits_indices=logits_indices)


def read_message(stream: BinaryIO, device: torch.device) -> Message | None:
    """The next message, or None at the end of the stream (rank 0 has closed it)."""
    header = stream.read(_LENGTH_BYTES)
    if len(header) < _LENGTH_BYTES:
        return None
    size = int.from_bytes(header, "little")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a worker message of {size:,} bytes is over {MAX_FRAME_BYTES:,}")
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return decode(payload, device)
