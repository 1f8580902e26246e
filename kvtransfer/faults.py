"""Fault injection on the KV channel, for tests: dropped, duplicated and delayed messages.

Off unless the environment variable `PDSERVE_KV_FAULTS` is set when a `ChannelSender` or
`ChannelReceiver` is constructed (read once, there; without it no message takes another path):

    PDSERVE_KV_FAULTS="drop_frame=0.2,dup_frame=0.2,delay_frame_ms=200,drop_done=0.1,seed=1"

Two kinds of message can be hit, each with its own rates:
  frame   prefill -> decode: `Data` (KV bytes, zmq transport) and `Written` (a direct copy
          landed, shm and cuda_ipc transports). Applied by the sender.
  done    decode -> prefill: `Committed` (every block of the transfer arrived). Applied by the
          receiver.
Keys, for KIND in (frame, done):
  drop_KIND       probability that a message is never sent
  dup_KIND        probability that it is sent twice
  delay_KIND_ms   hold messages this long before they leave (later ones may overtake them)
  delay_KIND      probability that a message is held (1.0 when only delay_KIND_ms is given)
  seed            seeds the draws (each process draws its own sequence)

A held or duplicated message is sent as a copy of its bytes at the moment it was due, as the
network would deliver it. The channel must stay correct under all of this: a transfer commits
only when every block of every layer arrived, and messages for a transfer that ended, or for
blocks outside its set, are refused (kvtransfer/ledger.py).
"""

from __future__ import annotations

import heapq
import logging
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_KV_FAULTS"
KINDS = ("frame", "done")
MAX_DELAY_MS = 60_000.0

SendFrames = Callable[[list[Any]], bool]


@dataclass(frozen=True)
class FaultRates:
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.0

    @property
    def active(self) -> bool:
        return self.drop > 0 or self.dup > 0 or (self.delay > 0 and self.delay_s > 0)


@dataclass(frozen=True)
class KVFaults:
    """What to inject, parsed from the `PDSERVE_KV_FAULTS` syntax."""

    rates: dict[str, FaultRates] = field(default_factory=dict)
    seed: int | None = None

    @classmethod
    def parse(cls, text: str) -> KVFaults:
        """Raises ValueError naming the bad item and what is allowed."""
        values: dict[str, float] = {}
        seed = None
        valid = sorted(
            [f"{p}_{k}" for k in KINDS for p in ("drop", "dup", "delay")]
            + [f"delay_{k}_ms" for k in KINDS]
            + ["seed"]
        )
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in valid:
                raise ValueError(f"{ENV_VAR}: {item!r} is not KEY=VALUE with KEY in {valid}")
            try:
                number = float(raw)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {key} is {raw.strip()!r}, not a number") from None
            if key == "seed":
                seed = int(number)
            elif key.endswith("_ms"):
                if not 0 <= number <= MAX_DELAY_MS:
                    raise ValueError(f"{ENV_VAR}: {key} is {number}; expected 0-{MAX_DELAY_MS:g}")
                values[key] = number
            elif not 0 <= number <= 1:
                raise ValueError(f"{ENV_VAR}: {key} is {number}; expected a probability 0-1")
            else:
                values[key] = number
        rates = {}
        for kind in KINDS:
            delay_ms = values.get(f"delay_{kind}_ms", 0.0)
            rates[kind] = FaultRates(
                drop=values.get(f"drop_{kind}", 0.0),
                dup=values.get(f"dup_{kind}", 0.0),
                delay=values.get(f"delay_{kind}", 1.0 if delay_ms else 0.0),
                delay_s=delay_ms / 1000,
            )
        return cls(rates, seed)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> KVFaults | None:
        """None when the variable is unset or empty (no fault injection)."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not text:
            return None
        faults = cls.parse(text)
        return faults if any(r.active for r in faults.rates.values()) else None

    def hits(self, kind: str) -> bool:
        rates = self.rates.get(kind)
        return rates is not None and rates.active


class FaultInjector:
    """Owned by one I/O thread (not thread-safe). `send` stands between the channel and its
    socket for the messages of a kind; `flush` sends the held messages that are due."""

    def __init__(self, faults: KVFaults, endpoint: str) -> None:
        self.faults = faults
        self.endpoint = endpoint
        self._rng = random.Random(faults.seed)
        self._held: list[tuple[float, int, SendFrames, list[bytes]]] = []
        self._order = 0
        self.counts = {"dropped": 0, "duplicated": 0, "delayed": 0}
        logger.warning("KV fault injection is ON for %s: %s", endpoint, faults)

    @classmethod
    def from_environ(cls, endpoint: str) -> FaultInjector | None:
        faults = KVFaults.from_environ()
        return cls(faults, endpoint) if faults is not None else None

    def hits(self, kind: str) -> bool:
        return self.faults.hits(kind)

    def send(self, kind: str, send: SendFrames, frames: list[Any], now: float) -> bool:
        rates = self.faults.rates[kind]
        rng = self._rng
        if rng.random() < rates.drop:
            self.counts["dropped"] += 1
            return True
        copies = 1
        if rng.random() < rates.dup:
            copies = 2
            self.counts["duplicated"] += 1
        if rates.delay_s > 0 and rng.random() < rates.delay:
            self.counts["delayed"] += 1
            snapshot = [bytes(frame) for frame in frames]
            for _ in range(copies):
                self._order += 1
                heapq.heappush(self._held, (now + rates.delay_s, self._order, send, snapshot))
            return True
        sent = send(frames)
        if copies == 2:
            send([bytes(frame) for frame in frames])
        return sent

    def next_due(self) -> float | None:
        return self._held[0][0] if self._held else None

    def flush(self, now: float) -> None:
        while self._held and self._held[0][0] <= now:
            _, _, send, frames = heapq.heappop(self._held)
            send(frames)

    def close(self) -> None:
        self._held.clear()
        logger.warning("KV fault injection for %s: %s", self.endpoint, self.counts)
