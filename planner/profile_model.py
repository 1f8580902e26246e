"""One node's step time as a function of what the step computes, fitted to a profile's
measured steps (planner/profile_file.py):

  seconds = overhead + a x prompt tokens + b x prompt attention pairs
                     + c x decoding sequences + d x their context tokens

Each term is one cost a step pays: a fixed launch and sampling cost, the prompt tokens'
matrix products, their attention (quadratic in the chunk), each decoded token's matrix
products and its attention over the cache. The coefficients are the non-negative least
squares fit with relative residuals (a 20 ms decode step counts as much as a 3 s prefill),
so a mixed step (a colocated node's decodes with a prompt chunk) costs its two parts' sum
plus one overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.planner.profile_file import StepSample, ThreadTable

TERMS = ("overhead", "prefill_tokens", "prefill_pairs", "decode_seqs", "decode_context")


@dataclass(frozen=True)
class StepCost:
    coefficients: tuple[float, ...]  # one per TERMS

    @staticmethod
    def fit(table: ThreadTable) -> StepCost:
        rows = np.array([_features(s) for s in table.steps], dtype=float)
        seconds = np.array([s.seconds for s in table.steps], dtype=float)
        weighted = rows / seconds[:, None]
        target = np.ones(len(seconds))
        active = list(range(len(TERMS)))
        while True:  # drop a negative term and refit: a small active-set NNLS
            solution, *_ = np.linalg.lstsq(weighted[:, active], target, rcond=None)
            negative = [active[i] for i, v in enumerate(solution) if v < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda j: solution[active.index(j)]))
        coefficients = [0.0] * len(TERMS)
        for index, value in zip(active, solution, strict=True):
            coefficients[index] = float(value)
        return StepCost(tuple(coefficients))

    def seconds(
        self, prefill_tokens: int, prefill_pairs: int, decode_seqs: int, decode_context: int
    ) -> float:
        overhead, a, b, c, d = self.coefficients
        return overhead + a * prefill_tokens + b * prefill_pairs + c * decode_seqs + (
            d * decode_context
        )

    def prefill_seconds(self, tokens: int, context_before: int = 0) -> float:
        sample = StepSample.prefill(tokens, context_before, 0.0)
        return self.seconds(sample.prefill_tokens, sample.prefill_pairs, 0, 0)

    def prefill_tokens_per_s(self, chunk: int) -> float:
        """Prompt tokens per second of one prompt computed in chunks of `chunk` tokens."""
        return chunk / self.prefill_seconds(chunk)

    def decode_seconds(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences of `context` tokens each."""
        return self.seconds(0, 0, batch, batch * context)

    def relative_errors(self, table: ThreadTable) -> list[float]:
        """|fitted - measured| / measured for each measured step."""
        return [
            abs(self.seconds(*_features(s)[1:]) - s.seconds) / s.seconds for s in table.steps
        ]


def _features(step: StepSample) -> tuple[int, ...]:
    return 1, step.prefill_tokens, step.prefill_pairs, step.decode_seqs, step.decode_context
