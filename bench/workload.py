"""The benchmark workload: random-token requests with fixed output lengths, the greedy
EOS-ignoring sampling every system uses on them, and how a run over them is counted."""

from __future__ import annotations

import dataclasses
import random
from typing import Any


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Throughput:
    """One system's run: useful tokens are the requests' own max_tokens, summed."""

    name: str
    num_requests: int
    useful_tokens: int
    computed_tokens: int  # generated tokens including static-batching waste
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def make_workload(
    tokenizer: Any,
    vocab_size: int,
    num_requests: int,
    seed: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
) -> list[Request]:
    """Random prompts over the non-special vocabulary, uniform lengths, all from `seed`."""
    special = tokenizer.added_token_ids
    vocab = [t for t in range(min(vocab_size, len(tokenizer))) if t not in special]
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompt = [rng.choice(vocab) for _ in range(length)]
        requests.append(Request(prompt, rng.randint(*output_len)))
    return requests


def greedy(max_tokens: int) -> Any:
    """pdserve's sampling parameters for a request: greedy, exactly `max_tokens` tokens."""
    from pdserve.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
