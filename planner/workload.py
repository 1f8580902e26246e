"""A workload file: how requests arrive and how long their prompts and outputs are.

JSON, every field bounded, an unknown or bad field refused by its path (`arrival.rate`):

  {"requests": 200, "seed": 0,
   "arrival": {"process": "gamma", "rate": 1.5, "burstiness": 0.5},
   "classes": [
     {"name": "chat", "share": 0.8, "prompt_tokens": [16, 64], "output_tokens": [48, 48],
      "shared_prefix": {"tokens": 120, "variants": 4}},
     {"name": "document", "share": 0.2, "prompt_tokens": [1200, 1600],
      "output_tokens": [16, 16]}]}

Arrival processes: `poisson` (rate), `gamma` (rate, burstiness: the gap's shape, bursty below
1; bench/serve_arrivals.py draws both) and `burst` (`size` requests at once every
`interval_s`). A class draws its prompt and output lengths uniformly from its [min, max]; with
a shared prefix, the prompt is one of `variants` prefixes of `tokens` tokens followed by its
own tokens (what a system prompt is to chat turns), and a node that computed that prefix
before has it in its prefix cache.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.serve_arrivals import arrival_times

MAX_REQUESTS = 5_000  # a plan simulates every one on every candidate
MAX_TOKENS = 1_000_000
MAX_RATE = 10_000.0
MAX_VARIANTS = 10_000
MAX_CLASSES = 16
PROCESSES = ("poisson", "gamma", "burst")


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulator sees it: lengths, not tokens."""

    arrival_s: float
    prompt_tokens: int  # the whole prompt, shared prefix included
    output_tokens: int
    prefix_id: str | None = None  # requests with the same id share their first prefix_tokens
    prefix_tokens: int = 0
    kind: str = ""


@dataclass(frozen=True)
class SharedPrefix:
    tokens: int
    variants: int


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    shared_prefix: SharedPrefix | None = None


@dataclass(frozen=True)
class Arrival:
    process: str
    rate: float = 1.0
    burstiness: float = 1.0
    size: int = 1
    interval_s: float = 1.0

    def times(self, count: int, seed: int) -> list[float]:
        if self.process == "burst":
            return [(i // self.size) * self.interval_s for i in range(count)]
        return arrival_times(count, self.rate, self.process, self.burstiness, seed)


@dataclass(frozen=True)
class Workload:
    requests: int
    seed: int
    arrival: Arrival
    classes: tuple[RequestClass, ...]

    def sample(self) -> list[SimRequest]:
        """The requests, the same for the same file (every draw from `seed`)."""
        rng = random.Random(f"workload-{self.seed}")
        out = []
        for at in self.arrival.times(self.requests, self.seed):
            cls = rng.choices(self.classes, weights=[c.share for c in self.classes])[0]
            own = rng.randint(*cls.prompt_tokens)
            output = rng.randint(*cls.output_tokens)
            prefix = cls.shared_prefix
            if prefix is None:
                out.append(SimRequest(at, own, output, kind=cls.name))
                continue
            variant = rng.randrange(prefix.variants)
            out.append(SimRequest(
                at, prefix.tokens + own, output, f"{cls.name}/{variant}", prefix.tokens, cls.name
            ))
        return out


def load_workload(path: Path) -> Workload:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"workload file {path}: {error}") from None
    return parse_workload(data)


def parse_workload(data: Any) -> Workload:
    fields = _Fields(data, "workload")
    requests = fields.integer("requests", 1, MAX_REQUESTS, default=200)
    seed = fields.integer("seed", 0, 2**31 - 1, default=0)
    arrival = _arrival(_Fields(fields.get("arrival"), "arrival"))
    raw_classes = fields.get("classes")
    if not isinstance(raw_classes, list) or not 1 <= len(raw_classes) <= MAX_CLASSES:
        raise ValueError(f"classes: expected a list of 1 to {MAX_CLASSES} request classes")
    classes = tuple(
        _request_class(_Fields(item, f"classes[{i}]"), i) for i, item in enumerate(raw_classes)
    )
    total = sum(c.share for c in classes)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ValueError(f"classes: the shares sum to {total:g}; expected 1")
    fields.done()
    return Workload(requests, seed, arrival, classes)


def _arrival(fields: _Fields) -> Arrival:
    process = fields.choice("process", PROCESSES)
    if process == "burst":
        arrival = Arrival(
            process,
            size=fields.integer("size", 1, MAX_REQUESTS),
            interval_s=fields.number("interval_s", 1e-3, 86_400.0),
        )
    else:
        rate = fields.number("rate", 1e-6, MAX_RATE)
        shape = 1.0 if process == "poisson" else fields.number("burstiness", 0.01, 100.0)
        arrival = Arrival(process, rate=rate, burstiness=shape)
    fields.done()
    return arrival


def _request_class(fields: _Fields, index: int) -> RequestClass:
    name = fields.text("name", default=f"class{index}")
    share = fields.number("share", 1e-6, 1.0)
    prompt = fields.token_range("prompt_tokens")
    output = fields.token_range("output_tokens")
    prefix = None
    if fields.has("shared_prefix"):
        sub = _Fields(fields.get("shared_prefix"), f"{fields.where}.shared_prefix")
        prefix = SharedPrefix(sub.integer("tokens", 1, MAX_TOKENS),
                              sub.integer("variants", 1, MAX_VARIANTS, default=1))
        sub.done()
    fields.done()
    return RequestClass(name, share, prompt, output, prefix)


class _Fields:
    """One JSON object read field by field; `done()` refuses the fields nobody read."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(  # noqa: TRY004 (every bad field is a ValueError)
                f"{where}: expected a JSON object, got {type(data).__name__}"
            )
        self.data, self.where, self.read = data, where, set()

    def has(self, name: str) -> bool:
        return name in self.data

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        if name not in self.data:
            if default is None:
                raise ValueError(f"{self.where}.{name}: missing")
            return default
        return self.data[name]

    def integer(self, name: str, low: int, high: int, default: int | None = None) -> int:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{self.where}.{name} is {value!r}; expected an integer in "
                             f"[{low:,}, {high:,}]")
        return value

    def number(self, name: str, low: float, high: float) -> float:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
            low <= value <= high
        ):
            raise ValueError(f"{self.where}.{name} is {value!r}; expected a number in "
                             f"[{low:g}, {high:g}]")
        return float(value)

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        value = self.get(name)
        if value not in allowed:
            raise ValueError(f"{self.where}.{name} is {value!r}; expected one of "
                             f"{', '.join(allowed)}")
        return value

    def text(self, name: str, default: str) -> str:
        value = self.get(name, default)
        if not isinstance(value, str) or not 1 <= len(value) <= 64:
            raise ValueError(f"{self.where}.{name} is {value!r}; expected 1 to 64 characters")
        return value

    def token_range(self, name: str) -> tuple[int, int]:
        value = self.get(name)
        if (
            not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 1 <= value[0] <= value[1] <= MAX_TOKENS
        ):
            raise ValueError(f"{self.where}.{name} is {value!r}; expected [min, max] tokens "
                             f"with 1 <= min <= max <= {MAX_TOKENS:,}")
        return value[0], value[1]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise ValueError(f"{self.where}: unknown field(s) {', '.join(unknown)}")
