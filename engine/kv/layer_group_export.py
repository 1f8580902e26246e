"""Prompt blocks leaving the engine by layer group: the blocks a step completes for requests
whose KV leaves this engine (a prefill node's), handed out group by group while the model's
forward computes the step, so the copy of a group's layers overlaps the compute of the next.

`layer_group_ends(num_layers, layers_per_group)` splits the layers into groups; the last one
ends at the last layer, so a group of every layer is one write after the forward.

Lifecycle of one step's export (`LayerGroupExport`, built by `LLMEngine.step`):
  planned    before the forward: each exporting request's blocks that the step completes (the
             partial last block with the prompt's last chunk); nothing emitted yet.
  streaming  the forward calls `layers_done(n)` after its n-th layer; where n ends a group
             but the last, every planned block is emitted over the layers since the previous
             group end (`emit(request_id, block_ids, layer_start, layer_end)`).
  finished   `finish()`, after the step's batch ran (forward and sampling), emits the layers not
             emitted yet: the last group, or all of them where the step's forward path has no
             per-layer hook (a one-token step) or ran under tensor parallelism (the other ranks'
             layers end on their own clocks). One group of every layer is thus one write after
             the batch, exactly as without streaming.
A step whose batch raised: the requests that raise alone are ended and `drop` forgets them; the
others each ran alone (engine/step_failure.py), so their KV is complete and `finish()` emits the
rest of their layers - unless nothing was emitted yet, then the engine forgets the plan and the
step's re-run exports the blocks. Either way each (block, layer) pair is emitted once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ExportEmitter = Callable[[str, list[int], int, int], None]


@dataclass(frozen=True)
class ExportSink:
    """Where a step's exported blocks go: `emit(request_id, block_ids, layer_start, layer_end)`
    at each of `group_ends` (from `layer_group_ends`)."""

    group_ends: tuple[int, ...]
    emit: ExportEmitter


def layer_group_ends(num_layers: int, layers_per_group: int) -> tuple[int, ...]:
    """The layer counts after which a group ends: (4, 8, 10) for 10 layers in groups of 4."""
    if num_layers < 1 or layers_per_group < 1:
        raise ValueError(
            f"{num_layers} layers in groups of {layers_per_group}; expected 1 or more of each"
        )
    ends = tuple(range(layers_per_group, num_layers, layers_per_group))
    return (*ends, num_layers)


class LayerGroupExport:
    def __init__(
        self,
        blocks: dict[str, list[int]],
        group_ends: tuple[int, ...],
        emit: ExportEmitter,
    ) -> None:
        self.blocks = blocks
        self.group_ends = frozenset(group_ends)
        self.num_layers = max(group_ends)
        self.emit = emit
        self.layers_sent = 0

    def layers_done(self, num_layers_done: int) -> None:
        """The forward finished its first `num_layers_done` layers. The last group waits for
        `finish()`: a step whose sampling raises then sends no request's every layer."""
        if num_layers_done in self.group_ends and num_layers_done < self.num_layers:
            self._emit_up_to(num_layers_done)

    def finish(self) -> None:
        """Every layer is computed: emits those not emitted yet."""
        if self.layers_sent < self.num_layers:
            self._emit_up_to(self.num_layers)

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.blocks.pop(request_id, None)

    def _emit_up_to(self, layer_end: int) -> None:
        for request_id, block_ids in self.blocks.items():
            self.emit(request_id, block_ids, self.layers_sent, layer_end)
        self.layers_sent = layer_end
