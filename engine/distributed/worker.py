"""A worker rank of a tensor-parallel engine: `python -m pdserve.engine.distributed.worker`.

Started by rank 0 (engine/distributed/rank_workers.py), which writes one JSON line of
settings on its stdin: the engine's options (its own device and thread count), its rank, the
group's size and the port of rank 0's store. It joins the group, loads its shard of the model
and sizes its shard of the KV cache with the same block count as every rank, then runs what
rank 0 sends, in order (engine/distributed/messages.py), until its stdin ends.

A step that raises here is logged and the loop goes on: a step's inputs are the same on every
rank, so rank 0 raised at the same point and its engine handles the failure (a collective
that cannot complete fails on its own, by the group's timeout or a closed connection).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import BinaryIO

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.distributed.group import RankGroup, connect_store
from pdserve.engine.distributed.messages import BlockSwap, StepInputs, read_message
from pdserve.engine.kv.swap_space import SwapSpace
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WorkerRank:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.swap_space: SwapSpace | None = None  # made on the first swap

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs) -> None:
        runner = self.runner
        runner.kv_cache.copy_blocks(inputs.blocks_to_copy)
        batch = inputs.batch
        metadata = runner.attention.prepare(batch)
        runner.model(
            batch.input_ids, batch.positions, inputs.logits_indices, runner.attention, metadata
        )

    def swap(self, message: BlockSwap) -> None:
        if self.swap_space is None:
            self.swap_space = SwapSpace.for_budget(
                self.runner.kv_cache, self.runner.config.swap_space
            )
        if message.to_host:
            self.swap_space.swap_out(message.pairs)
        else:
            self.swap_space.swap_in(message.pairs)

    def serve(self, stream: BinaryIO) -> None:
        """Runs messages until the stream ends."""
        while True:
            message = read_message(stream, self.runner.device)
            if message is None:
                return
            try:
                if isinstance(message, StepInputs):
                    self.run_step(message)
                else:
                    self.swap(message)
            except Exception:  # rank 0 met the same inputs (module docstring)
                logger.exception("tensor-parallel rank %d: a step failed", self.runner.group.rank)


def main() -> None:
    # Its life follows rank 0's (the end of its pipe), not a terminal's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stream = sys.stdin.buffer
    settings = json.loads(stream.readline())
    rank, size = settings["rank"], settings["size"]
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s"
    )
    config = EngineConfig(**settings["config"])
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = config.resolve_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store(settings["port"], size, settings["timeout_s"])
    store.set(f"rank{rank}/up", "1")
    group = RankGroup.join(store, rank, size, device, settings["timeout_s"])
    runner = ModelRunner(
        config,
        ModelConfig.from_folder(config.model),
        settings["max_model_len"],
        group=group,
    )
    WorkerRank(runner).serve(stream)


if __name__ == "__main__":
    main()
