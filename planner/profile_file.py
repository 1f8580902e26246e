"""A profile: the step times one node of this model measured on this device
(`pdserve profile`, planner/profile.py), the KV numbers a transfer needs, and the machine.

Each measured step is a `StepSample`: how much prompt it computed, how many sequences it
decoded and over how much context, and its seconds. A profile holds one table of samples
per thread count measured (on a CPU host a node's speed depends on its share of the cores;
on a GPU there is one table, `threads` None). JSON, versioned; `load_profile` checks every
field before the planner uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILE_VERSION = 1


@dataclass(frozen=True)
class StepSample:
    prefill_tokens: int  # prompt tokens computed in the step
    prefill_pairs: int  # query-key pairs their attention computed
    decode_seqs: int  # sequences that decoded one token
    decode_context: int  # the context tokens those sequences attended to, summed
    seconds: float

    @staticmethod
    def prefill(tokens: int, context_before: int, seconds: float) -> StepSample:
        """A chunk of `tokens` prompt tokens after `context_before` computed ones."""
        return StepSample(tokens, tokens * context_before + tokens * (tokens + 1) // 2, 0, 0,
                          seconds)


@dataclass(frozen=True)
class ThreadTable:
    threads: int | None  # torch threads of the node (None: a GPU, or torch's default)
    steps: list[StepSample]


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    device: str
    block_size: int
    max_num_batched_tokens: int  # the budget the samples were measured under
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # one node's KV cache at its default size
    transfer_bytes_per_s: float  # a copy of KV-sized buffers (what the KV transport moves)
    tables: list[ThreadTable]
    machine: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # how long the measurement took

    def table(self, threads: int | None) -> ThreadTable:
        """The table for `threads`, or the nearest measured thread count."""
        if threads is None:
            return max(self.tables, key=lambda t: t.threads or 0)
        return min(self.tables, key=lambda t: (abs((t.threads or threads) - threads), t.threads))


def save_profile(profile: Profile, path: Path) -> None:
    data = {"version": PROFILE_VERSION, **asdict(profile)}
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def load_profile(path: Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"profile {path}: {error}") from None
    try:
        return profile_from_dict(data)
    except (KeyError, TypeError) as error:
        raise ValueError(f"profile {path}: missing or malformed field {error}") from None


def profile_from_dict(data: dict) -> Profile:
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"profile version is {data.get('version')!r}; this pdserve reads {PROFILE_VERSION} "
            "(measure again with `pdserve profile`)"
        )
    tables = [
        ThreadTable(t["threads"], [StepSample(**s) for s in t["steps"]]) for t in data["tables"]
    ]
    profile = Profile(
        str(data["model"]), str(data["dtype"]), str(data["device"]), int(data["block_size"]),
        int(data["max_num_batched_tokens"]), int(data["kv_bytes_per_token"]),
        int(data["kv_capacity_tokens"]), float(data["transfer_bytes_per_s"]), tables,
        {str(k): str(v) for k, v in data.get("machine", {}).items()}, float(data["seconds"]),
    )
    _check(profile)
    return profile


def _check(profile: Profile) -> None:
    positive = {
        "block_size": profile.block_size, "kv_bytes_per_token": profile.kv_bytes_per_token,
        "kv_capacity_tokens": profile.kv_capacity_tokens,
        "max_num_batched_tokens": profile.max_num_batched_tokens,
        "transfer_bytes_per_s": profile.transfer_bytes_per_s,
    }
    for name, value in positive.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"profile {name} is {value!r}; expected a positive number")
    if not profile.tables:
        raise ValueError("profile has no step table")
    for table in profile.tables:
        if table.threads is not None and table.threads < 1:
            raise ValueError(f"profile table threads is {table.threads}; expected >= 1")
        if not any(s.prefill_tokens for s in table.steps) or not any(
            s.decode_seqs for s in table.steps
        ):
            raise ValueError(
                f"profile table for {table.threads} threads needs prefill and decode steps"
            )
        for step in table.steps:
            if not (step.seconds > 0 and math.isfinite(step.seconds)) or min(
                step.prefill_tokens, step.prefill_pairs, step.decode_seqs, step.decode_context
            ) < 0:
                raise ValueError(f"profile step {step} has a negative count or bad seconds")
