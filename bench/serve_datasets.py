"""The serving benchmark's prompts, as token-id lists drawn from a vocabulary of ordinary
(non-special) token ids. Every dataset is deterministic for a given seed.

  random         input and output lengths uniform in [len x (1 - r), len x (1 + r)]
  shared-prefix  `groups` prefixes of `prefix_len` tokens, each followed by `prompts_per_group`
                 different suffixes of `suffix_len` tokens; the prompts are shuffled
  chat           lognormal input and output lengths (median and sigma of each), clipped to
                 [min_len, max]: many short turns and a long tail, like chat logs
  trace          replay of a Mooncake-format JSONL trace (timestamp in ms, input_length,
                 output_length, hash_ids): hash id h stands for one block of `block_size`
                 tokens generated from h alone, so requests sharing hash ids share prefixes

Requests come out with `at` = 0 except trace requests, whose `at` follows the timestamps.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.serve_arrivals import trace_times
from pdserve.bench.serve_load import LoadRequest

DATASETS = ("random", "shared-prefix", "chat", "trace")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} is {value}; expected at least 1")


@dataclass
class RandomSpec:
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        _positive("--input-len", self.input_len)
        _positive("--output-len", self.output_len)
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio is {self.range_ratio}; expected 0 <= r < 1")


@dataclass
class SharedPrefixSpec:
    groups: int = 8
    prompts_per_group: int = 8
    prefix_len: int = 512
    suffix_len: int = 64
    output_len: int = 128

    def __post_init__(self) -> None:
        for name, value in (
            ("--groups", self.groups),
            ("--prompts-per-group", self.prompts_per_group),
            ("--prefix-len", self.prefix_len),
            ("--suffix-len", self.suffix_len),
            ("--output-len", self.output_len),
        ):
            _positive(name, value)


@dataclass
class ChatSpec:
    input_median: float = 150.0
    input_sigma: float = 1.0
    input_max: int = 1024
    output_median: float = 120.0
    output_sigma: float = 0.8
    output_max: int = 512
    min_len: int = 4

    def __post_init__(self) -> None:
        _positive("--chat-min-len", self.min_len)
        for name, median, sigma, top in (
            ("input", self.input_median, self.input_sigma, self.input_max),
            ("output", self.output_median, self.output_sigma, self.output_max),
        ):
            if not median > 0 or not sigma >= 0:
                raise ValueError(
                    f"--chat-{name}-median {median} and --chat-{name}-sigma {sigma}: "
                    "expected a positive median and a sigma >= 0"
                )
            if top < self.min_len:
                raise ValueError(
                    f"--chat-{name}-max is {top}; expected at least --chat-min-len {self.min_len}"
                )


@dataclass
class TraceSpec:
    path: str
    block_size: int = 512
    speedup: float = 1.0

    def __post_init__(self) -> None:
        _positive("--trace-block-size", self.block_size)
        if not self.speedup > 0:
            raise ValueError(f"--trace-speedup is {self.speedup}; expected a positive number")


def _draw(rng: random.Random, vocab: list[int], n: int) -> list[int]:
    return rng.choices(vocab, k=n)


def _check_vocab(vocab: list[int], needed: int = 1) -> None:
    if len(vocab) < needed:
        raise ValueError(f"the vocabulary has {len(vocab)} usable ids; this dataset needs {needed}")


def random_requests(
    spec: RandomSpec, count: int, vocab: list[int], seed: int | str
) -> list[LoadRequest]:
    _check_vocab(vocab)
    rng = random.Random(f"random-{seed}")

    def length(center: int) -> int:
        low = max(1, math.ceil(center * (1 - spec.range_ratio)))
        return rng.randint(low, max(low, math.floor(center * (1 + spec.range_ratio))))

    requests = []
    for _ in range(count):
        prompt_len, output_len = length(spec.input_len), length(spec.output_len)
        requests.append(LoadRequest(0.0, _draw(rng, vocab, prompt_len), output_len, "random"))
    return requests


def shared_prefix_requests(
    spec: SharedPrefixSpec, vocab: list[int], seed: int
) -> list[LoadRequest]:
    """Group g's prompts are `kind` "group-g". Group prefixes start with different tokens and
    a group's suffixes start with different tokens, so prompts share exactly their prefix."""
    _check_vocab(vocab, max(spec.groups, spec.prompts_per_group))
    rng = random.Random(f"shared-prefix-{seed}")
    requests = []
    for g, head in enumerate(rng.sample(vocab, spec.groups)):
        prefix = [head, *_draw(rng, vocab, spec.prefix_len - 1)]
        for first in rng.sample(vocab, spec.prompts_per_group):
            suffix = [first, *_draw(rng, vocab, spec.suffix_len - 1)]
            requests.append(LoadRequest(0.0, prefix + suffix, spec.output_len, f"group-{g}"))
    rng.shuffle(requests)
    return requests


def chat_lengths(spec: ChatSpec, count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(f"chat-{seed}")

    def length(median: float, sigma: float, top: int) -> int:
        return min(top, max(spec.min_len, round(rng.lognormvariate(math.log(median), sigma))))

    return [
        (
            length(spec.input_median, spec.input_sigma, spec.input_max),
            length(spec.output_median, spec.output_sigma, spec.output_max),
        )
        for _ in range(count)
    ]


def chat_requests(spec: ChatSpec, count: int, vocab: list[int], seed: int) -> list[LoadRequest]:
    _check_vocab(vocab)
    rng = random.Random(f"chat-tokens-{seed}")
    return [
        LoadRequest(0.0, _draw(rng, vocab, prompt_len), output_len, "chat")
        for prompt_len, output_len in chat_lengths(spec, count, seed)
    ]


def trace_block(hash_id: int, block_size: int, vocab: list[int]) -> list[int]:
    """The tokens hash id `hash_id` stands for: the same id always gives the same block."""
    return _draw(random.Random(f"block-{hash_id}"), vocab, block_size)


def read_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(
                    {
                        "timestamp": float(row["timestamp"]),
                        "input_length": int(row["input_length"]),
                        "output_length": int(row["output_length"]),
                        "hash_ids": [int(h) for h in row.get("hash_ids", [])],
                    }
                )
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{path} line {number}: expected JSON with timestamp, input_length, "
                    f"output_length and hash_ids ({error!r})"
                ) from error
    return rows


def trace_requests(
    spec: TraceSpec, vocab: list[int], limit: int | None = None, seed: int = 0
) -> list[LoadRequest]:
    """Prompts are the hash ids' blocks cut to input_length (request-specific tokens fill any
    length the hash ids do not cover); send times are the timestamps / speedup."""
    _check_vocab(vocab)
    rows = read_trace(spec.path, limit)
    blocks: dict[int, list[int]] = {}
    times = trace_times([row["timestamp"] for row in rows], spec.speedup)
    requests = []
    for index, (row, at) in enumerate(zip(rows, times)):
        target, prompt = max(1, row["input_length"]), []
        for hash_id in row["hash_ids"]:
            if len(prompt) >= target:
                break
            if hash_id not in blocks:
                blocks[hash_id] = trace_block(hash_id, spec.block_size, vocab)
            prompt += blocks[hash_id]
        missing = max(0, target - len(prompt))
        prompt = prompt[:target] + _draw(
            random.Random(f"trace-tail-{seed}-{index}"), vocab, missing
        )
        requests.append(LoadRequest(at, prompt, max(1, row["output_length"]), "trace"))
    return requests


def warmup_requests(count: int, vocab: list[int], seed: int) -> list[LoadRequest]:
    """Short requests (64-token prompts, 8 tokens out) unrelated to the measured prompts, so
    warming up fills no prefix cache the measured run could hit."""
    return random_requests(RandomSpec(64, 8), count, vocab, seed=f"warmup-{seed}")
