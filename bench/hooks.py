"""Driving and instrumenting a live pdserve engine from outside: temporary method wrappers
(timing, profiler ranges, counting) and small step/abort helpers. Every wrapper is undone when
its ``with`` block ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def patched(obj: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Temporarily replaces obj.name with make(original) (instance or module attribute)."""
    original = getattr(obj, name)
    owned = not hasattr(obj, "__dict__") or name in vars(obj)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if owned:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def timed(sink: list[float]) -> Callable[[Callable], Callable]:
    """Wraps a callable to append each call's wall time to `sink`."""

    def make(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(time.perf_counter() - start)

        return wrapper

    return make


def labelled(label: str) -> Callable[[Callable], Callable]:
    """Wraps a callable in a torch.profiler range named `label`."""

    def make(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return wrapper

    return make


def counted(sink: list[int]) -> Callable[[Callable], Callable]:
    """Wraps Scheduler.schedule to record each step's number of batched tokens."""

    def make(schedule: Callable) -> Callable:
        def wrapper() -> Any:
            out = schedule()
            sink.append(out.num_batched_tokens)
            return out

        return wrapper

    return make


def step_until(engine: Any, done: Callable[[], bool], limit: int = 10_000) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise RuntimeError("the engine did not reach the expected state")


def abort_all(engine: Any, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)
