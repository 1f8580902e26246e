"""One rank's side of its tensor-parallel group: the collectives the sharded model calls.

The group is a process group of its own (gloo on the CPU, NCCL on CUDA), built from a TCP
store on 127.0.0.1 whose port rank 0 takes from the OS: nothing global is set
(`torch.distributed.init_process_group` is never called), so several engines, each with its
own group, can live in one process. A group of one rank (`RankGroup.single()`) runs no
collective at all.

Every collective waits at most `timeout`: a rank that died closes its connections and the
others' collective fails at once; one that hangs makes them fail when the timeout passes.
Either way it raises `RankFailure`, which no request caused: the engine cannot go on
(engine/step_failure.py lets it through). Collectives are only ever issued inside a step, so
an idle engine never waits on one.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group died, hung or closed its pipe: the engine is broken."""


def open_store(size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store on a free port of 127.0.0.1 (`store.port`); the others connect to it.

    The listening socket is bound here, to loopback alone, and handed to the store: given a
    port, TCPStore's server would listen on every interface of the host."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((STORE_HOST, 0))
        listener.listen()
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(
        STORE_HOST,
        port,
        size,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


def connect_store(port: int, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(
        STORE_HOST, port, size, False, timeout=datetime.timedelta(seconds=timeout_s)
    )


class RankGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        process_group: dist.ProcessGroup | None,
        device: torch.device | None = None,
        store: dist.Store | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.process_group = process_group
        self.device = device or torch.device("cpu")
        self.store = store

    @classmethod
    def single(cls) -> RankGroup:
        return cls(0, 1, None)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> RankGroup:
        """Blocks until all `size` ranks have joined (or the store's timeout passes)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(rank, size, group, device, store)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` (contiguous) over the ranks, in place; returns it."""
        if self.process_group is not None:
            _wait(self.process_group.allreduce([tensor]), "all-reduce")
        return tensor

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.process_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        _wait(self.process_group.allreduce([tensor], options), "all-reduce")
        return int(tensor.item())

    def publish(self, key: str, value: str) -> None:
        """Rank 0 names something for the other ranks (`published`)."""
        self.store.set(key, value)

    def published(self, key: str) -> str:
        """What rank 0 published under `key`, waiting for it up to the store's timeout."""
        return self.store.get(key).decode()

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `tensor` (same shape on each) joined along the last dimension,
        in rank order; the other ranks: None."""
        if self.process_group is None:
            return tensor
        tensor = tensor.contiguous()
        parts = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.is_first else []
        options = dist.GatherOptions()
        options.rootRank = 0
        _wait(self.process_group.gather(parts, [tensor], options), "gather")
        return torch.cat(parts[0], dim=-1) if self.is_first else None


def _wait(work: dist.Work, name: str) -> None:
    try:
        work.wait()
    except RuntimeError as error:
        raise RankFailure(f"a tensor-parallel {name} failed: {error}") from error
