"""How many KV blocks a sequence is expected to need in total, which admission reserves.

  optimistic  only the blocks of the next chunk: admit while blocks are free, preempt when
              they run out (the default; as vLLM).
  worst-case  prompt + max_tokens: an admitted sequence can always finish without preemption,
              at the price of low concurrency when outputs end early.
  predicted   prompt + a predicted output length: the `quantile` of the fractions of max_tokens
              that finished requests used (over the last `window` of them), times this
              request's max_tokens; requests that ignore EOS are predicted at max_tokens, and
              until `min_observations` requests have finished, so is every request.
              A request that outgrows its prediction takes blocks as it goes; preemption covers
              the misses.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.sequence import Sequence

ADMISSION_POLICIES = ("optimistic", "worst-case", "predicted")


class OutputLengthPredictor:
    def __init__(self, quantile: float, window: int = 1000, min_observations: int = 16) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"admission quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.min_observations = min_observations
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    def observe(self, num_output_tokens: int, max_tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            oldest = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        fraction = num_output_tokens / max_tokens
        self._recent.append(fraction)
        bisect.insort(self._sorted, fraction)

    def predict(self, max_tokens: int, ignore_eos: bool) -> int:
        if ignore_eos or len(self._sorted) < self.min_observations:
            return max_tokens
        index = min(len(self._sorted) - 1, math.ceil(self.quantile * len(self._sorted)) - 1)
        return max(1, min(max_tokens, math.ceil(self._sorted[index] * max_tokens)))


class AdmissionPolicy:
    def __init__(self, policy: str, block_size: int, quantile: float = 0.9) -> None:
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.predictor = OutputLengthPredictor(quantile)

    def expected_blocks(self, seq: Sequence) -> int:
        """Blocks seq is expected to hold at its end (0 under the optimistic policy)."""
        if self.policy == "optimistic":
            return 0
        params = seq.params
        if self.policy == "worst-case":
            output = params.max_tokens
        else:
            output = self.predictor.predict(params.max_tokens, params.ignore_eos)
        blocks = -(-(seq.num_prompt_tokens + output) // self.block_size)
        # n choices of one prompt share its full blocks; each holds the rest of its own
        shared = seq.num_prompt_tokens // self.block_size
        return blocks + (seq.num_seqs - 1) * (blocks - shared)

    def outstanding_blocks(self, running: Iterable[Sequence]) -> int:
        """Blocks the running sequences are still expected to take beyond those they hold."""
        if self.policy == "optimistic":
            return 0
        return sum(max(0, self.expected_blocks(s) - len(s.block_table)) for s in running)

    def observe_finished(self, seq: Sequence, reason: str) -> None:
        if reason in ("stop", "length"):
            self.predictor.observe(seq.num_output_tokens, seq.params.max_tokens)
