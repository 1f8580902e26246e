"""The ways a step's batch can go through the model, in the order the runner tries them: the
first whose `can_run(batch)` holds runs it (`choose`).

  1. `GraphReplay` (cuda_graphs.py): a pure-decode step that fits a captured batch size;
  2. `OneTokenDecode` (one_token_step.py, fp32_one_token_step.py): one sequence decoding one
     token, CPU bf16 (AVX512-BF16), fp32 or int8 weights;
  3. `DecodeBatch` (decode_batch_step.py): a step of decodes only, CPU bf16 or fp32 (int8
     weights included);
  4. `ModelForward`: the model's own forward, which runs any batch (prefill chunks, mixed steps,
     prompt logprobs) and is always last.
The runner builds the list once, with only the paths its model, device and cache can take. The
three faster paths give logits for every sequence of the batch and none for prompt positions,
so none of them takes a step that scores prompt logprobs. Only `ModelForward` reports each layer
it finished (`ForwardBatch.layers_done`, for blocks streamed by layer group); the others never
run a prompt chunk of more than one token, and their owner emits every layer after them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.batch import FlatBatch
from pdserve.engine.runner.decode_batch_step import DecodeBatchStep
from pdserve.engine.runner.fp32_one_token_step import Fp32OneTokenStep
from pdserve.engine.runner.one_token_step import OneTokenStep

if TYPE_CHECKING:
    from pdserve.engine.runner.cuda_graphs import DecodeGraphs


@dataclass
class ForwardBatch:
    """A step's flat batch and the rows whose logits it wants: the sampled positions
    (`flat.logits_indices`), then, when the step scores prompt logprobs, the scored ones."""

    flat: FlatBatch
    logits_indices: torch.Tensor
    scores_prompts: bool
    layers_done: Callable[[int], None] | None = None

    @property
    def decodes_only(self) -> bool:
        """Whether every sequence computes one token after a context, with no prompt scored."""
        flat = self.flat
        return (
            not self.scores_prompts
            and flat.num_tokens == flat.num_seqs
            and all(n > 0 for n in flat.context_lens)
        )


class ForwardPath(ABC):
    name: str

    @abstractmethod
    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether this path computes the batch's logits."""

    @abstractmethod
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] of the step, its KV written."""


class GraphReplay(ForwardPath):
    name = "cuda_graphs"

    def __init__(self, graphs: DecodeGraphs):
        self.graphs = graphs

    def can_run(self, batch: ForwardBatch) -> bool:
        return not batch.scores_prompts and self.graphs.can_run(batch.flat)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        return self.graphs.run(batch.flat)


class OneTokenDecode(ForwardPath):
    name = "one_token_step"

    def __init__(self, step: OneTokenStep | Fp32OneTokenStep):
        self.step = step

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.decodes_only and batch.flat.num_seqs == 1

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        flat = batch.flat
        return self.step(flat.input_ids, flat.block_tables[0], flat.seq_lens[0])


class DecodeBatch(ForwardPath):
    name = "decode_batch_step"

    def __init__(self, step: DecodeBatchStep):
        self.step = step

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.decodes_only

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        flat = batch.flat
        return self.step(flat.input_ids, flat.positions, flat.block_tables, flat.seq_lens)


class ModelForward(ForwardPath):
    name = "model"

    def __init__(self, model: torch.nn.Module, attention: AttentionBackend):
        self.model = model
        self.attention = attention

    def can_run(self, batch: ForwardBatch) -> bool:
        return True

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        flat = batch.flat
        metadata = self.attention.prepare(flat)
        return self.model(
            flat.input_ids, flat.positions, batch.logits_indices, self.attention, metadata,
            batch.layers_done,
        )


def choose(paths: list[ForwardPath], batch: ForwardBatch) -> ForwardPath:
    """The first path of `paths` that can run `batch` (the list ends with `ModelForward`)."""
    return next(path for path in paths if path.can_run(batch))
