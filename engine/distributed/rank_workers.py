"""Rank 0's handle on the worker ranks 1..N-1 of a tensor-parallel engine.

Process layout: the engine's own process is rank 0 (scheduler, block manager, sampler, its
shard of the model and of the KV cache); `start` launches one process per other rank
(`python -m pdserve.engine.distributed.worker`), hands each its settings as one JSON line on
its stdin, and then sends it every step's inputs and block swaps on that pipe
(engine/distributed/messages.py). All ranks join one process group (engine/distributed/
group.py) for the forward's collectives.

Lifetime: `close()` (or the engine being collected, or this process exiting) closes the pipes;
a worker exits at the end of its pipe, and one that has not within `STOP_TIMEOUT_S` is killed.
A worker that exits early makes the next `send` (or a collective) raise, naming its rank and
exit code: the engine fails loudly instead of waiting on it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from pdserve.engine.batch import FlatBatch
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.cpu_features import usable_cores
from pdserve.engine.distributed.group import DEFAULT_TIMEOUT_S, RankFailure, RankGroup, open_store
from pdserve.engine.distributed.messages import BlockSwap, Message, StepInputs, encode
from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.kv.swap_space import SwapSpace
from pdserve.wire.child_command import python_module_command
from pdserve.wire.config_flags import as_values

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
WORKER_MODULE = "pdserve.engine.distributed.worker"


def rank_threads(num_threads: int | None, size: int, device: torch.device) -> int | None:
    """Torch threads of each rank: on the CPU an equal share of the node's (`num_threads`, else
    every usable core), at least one; on CUDA `num_threads` as given (None: torch's default)."""
    if device.type == "cuda":
        return num_threads
    return max(1, (num_threads or usable_cores()) // size)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU for every rank, or the `rank`-th GPU from rank 0's."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor-parallel rank {rank} needs cuda:{index}, but {torch.cuda.device_count()} "
            "GPU(s) are visible"
        )
    return torch.device("cuda", index)


class RankWorkers:
    def __init__(
        self, processes: list[subprocess.Popen], group: RankGroup, store: dist.Store
    ) -> None:
        self.processes = processes
        self.group = group
        self.store = store  # rank 0 serves it: it lives as long as the group
        self._finalizer = weakref.finalize(self, _stop, processes)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_path: Path,
        max_model_len: int,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> RankWorkers:
        """Launches ranks 1..N-1 and joins their group (N = `config.tensor_parallel_size`);
        sets this process's torch threads to its rank's share. RankFailure, naming the rank
        and its exit code, if one exits before joining."""
        size = config.tensor_parallel_size
        threads = rank_threads(config.num_threads, size, device)
        if threads is not None:
            torch.set_num_threads(threads)
        devices = [rank_device(device, rank) for rank in range(size)]
        store = open_store(size, timeout_s)
        processes: list[subprocess.Popen] = []
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        try:
            for rank in range(1, size):
                values = as_values(config)
                values.update(model=str(model_path), device=str(devices[rank]), num_threads=threads)
                settings = {
                    "config": values,
                    "rank": rank,
                    "size": size,
                    "port": store.port,
                    "max_model_len": max_model_len,
                    "timeout_s": timeout_s,
                }
                process = subprocess.Popen(
                    python_module_command(WORKER_MODULE), stdin=subprocess.PIPE, env=env
                )
                processes.append(process)
                process.stdin.write(json.dumps(settings).encode() + b"\n")
                process.stdin.flush()
            _wait_until_joined(store, processes, timeout_s)
            group = RankGroup.join(store, 0, size, devices[0], timeout_s)
        except BaseException:
            _stop(processes)
            raise
        logger.info(
            "tensor parallel: %d ranks (worker pids %s), %s threads each",
            size,
            ", ".join(str(p.pid) for p in processes),
            threads or "default",
        )
        return cls(processes, group, store)

    def send(self, message: Message) -> None:
        """Sends every worker `message`; RankFailure naming a worker that has exited."""
        frame = encode(message)
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise _exited(rank, process)
            try:
                process.stdin.write(frame)
                process.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as error:
                raise _exited(rank, process) from error

    def send_step(
        self, blocks_to_copy: list[tuple[int, int]], batch: FlatBatch, logits_indices: torch.Tensor
    ) -> None:
        self.send(StepInputs(blocks_to_copy, batch, logits_indices))

    def swap_space(self, kv_cache: KVCache, swap_space_bytes: int) -> SwapSpace:
        return MirroredSwapSpace.for_workers(self, kv_cache, swap_space_bytes)

    def close(self) -> None:
        self._finalizer()


class MirroredSwapSpace(SwapSpace):
    """Rank 0's swap space: each swap is sent to the workers, which move their shards of the
    same blocks, then done here."""

    workers: RankWorkers

    @classmethod
    def for_workers(
        cls, workers: RankWorkers, kv_cache: KVCache, swap_space_bytes: int
    ) -> MirroredSwapSpace:
        space = cls(kv_cache, swap_space_bytes // kv_cache.spec.bytes_per_block)
        space.workers = workers
        return space

    def swap_out(self, pairs: list[tuple[int, int]]) -> tuple[int, float]:
        if pairs:
            self.workers.send(BlockSwap(to_host=True, pairs=pairs))
        return super().swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> tuple[int, float]:
        if pairs:
            self.workers.send(BlockSwap(to_host=False, pairs=pairs))
        return super().swap_in(pairs)


def _exited(rank: int, process: subprocess.Popen) -> RankFailure:
    code = process.poll()
    state = f"exited with code {code}" if code is not None else "closed its pipe"
    return RankFailure(f"tensor-parallel rank {rank} (pid {process.pid}) {state}")


def _wait_until_joined(
    store: dist.Store, processes: list[subprocess.Popen], timeout_s: float
) -> None:
    """Waits for every worker's key in the store, failing at once if one exits first."""
    deadline = time.monotonic() + timeout_s
    keys = [f"rank{rank}/up" for rank in range(1, len(processes) + 1)]
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise _exited(rank, process)
        if time.monotonic() > deadline:
            raise RankFailure(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
        time.sleep(0.05)


def _stop(processes: list[subprocess.Popen]) -> None:
    """Closes every worker's pipe (its signal to exit), waits, then kills what remains."""
    for process in processes:
        try:
            process.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
