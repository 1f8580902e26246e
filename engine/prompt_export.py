"""The prompt blocks an engine exports: a prefill node's requests, whose KV leaves the engine.

Lifecycle of one exporting request's blocks:
  start(id)    `add_request(..., export_prompt_blocks=True)`: nothing exported yet
  plan()       each step, before its forward: the prompt blocks the step completes (all its
               tokens computed; the partial last one with the prompt's last chunk), as a
               `LayerGroupExport` (engine/kv/layer_group_export.py) that emits them by layer
               group while the forward runs, or all at once after it. A block is held (the
               engine's `HeldBlocks`) from its first layers' emission until the owner's
               `release_blocks`, so neither the request's end nor prefix-cache eviction can
               reuse it while a transfer may still read it; it is listed in the step's
               `exported_blocks` too
  settle()     after a step's batch raised: the culprits' blocks are forgotten; with nothing
               emitted yet the plan is undone (a re-run exports them); else, after the others
               ran alone, the rest of their layers leave
  forget(id)   the request ended (finished, forked, aborted): its count goes; holds stay
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.layer_group_export import ExportSink, LayerGroupExport
from pdserve.engine.outputs import EngineStep
from pdserve.engine.sched.scheduler import SchedulerOutput


class PromptExport:
    def __init__(
        self, block_manager: BlockManager, num_layers: int, hold: Callable[[list[int]], None]
    ) -> None:
        self.block_manager = block_manager
        self.num_layers = num_layers
        self.hold = hold
        self.num_exported_blocks: dict[str, int] = {}  # request id -> prompt blocks exported

    def start(self, request_id: str) -> None:
        self.num_exported_blocks[request_id] = 0

    def forget(self, request_id: str) -> None:
        self.num_exported_blocks.pop(request_id, None)

    def plan(
        self, schedule: SchedulerOutput, export: ExportSink | None, result: EngineStep
    ) -> LayerGroupExport | None:
        """The prompt blocks this step completes for exporting requests (None when none)."""
        blocks = {}
        for scheduled in schedule.scheduled:
            seq = scheduled.seq
            start = self.num_exported_blocks.get(seq.request_id)
            if start is None:
                continue
            computed = seq.num_computed_tokens + scheduled.num_new_tokens
            if computed >= seq.num_prompt_tokens:
                filled = self.block_manager.blocks_for_tokens(seq.num_prompt_tokens)
            else:
                filled = computed // self.block_manager.block_size
            if filled <= start:  # e.g. recomputing after a preemption: already exported
                continue
            blocks[seq.request_id] = seq.block_table[start:filled]
            self.num_exported_blocks[seq.request_id] = filled
        if not blocks:
            return None

        def emit(request_id: str, block_ids: list[int], layer_start: int, layer_end: int) -> None:
            if layer_start == 0:
                self.hold(block_ids)
                result.exported_blocks.setdefault(request_id, []).extend(block_ids)
            if export is not None:
                export.emit(request_id, block_ids, layer_start, layer_end)

        group_ends = export.group_ends if export is not None else (self.num_layers,)
        return LayerGroupExport(blocks, group_ends, emit)

    def settle(self, exporting: LayerGroupExport, others_ran_alone: bool) -> None:
        """After a step's batch raised; with no culprit found (`others_ran_alone` False) the
        caller fails every request, and what left is released with its transfer."""
        exporting.drop([r for r in exporting.blocks if r not in self.num_exported_blocks])
        if exporting.layers_sent == 0:
            for request_id, block_ids in exporting.blocks.items():
                self.num_exported_blocks[request_id] -= len(block_ids)
        elif others_ran_alone:
            exporting.finish()
