"""Which cure a preempted sequence gets: recompute (drop its KV, prefill it again later) or swap
(copy its KV to host memory and back).

`mode` "recompute" and "swap" are fixed choices ("swap" falls back to recompute when the swap
space is full). "auto" compares, per sequence, the time each cure is expected to cost:
  recompute: its computed tokens / the measured prefill speed (tokens per second);
  swap:      its KV bytes, out and back in / the measured host-copy bandwidth.
Both speeds start at a prior and follow an exponential moving average of what the engine
measures (`observe_prefill`, `observe_copy`), so the choice adapts to the device.
"""

from __future__ import annotations

PREEMPTION_MODES = ("auto", "recompute", "swap")

_PRIOR_PREFILL_TOKENS_PER_S = 2_000.0
_PRIOR_COPY_BYTES_PER_S = 4e9
_SMOOTHING = 0.2
_MIN_PREFILL_TOKENS_TO_MEASURE = 64
_MIN_COPY_BYTES_TO_MEASURE = 1 << 20


class PreemptionPolicy:
    def __init__(self, mode: str, bytes_per_token: int) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.bytes_per_token = bytes_per_token
        self.prefill_tokens_per_s = _PRIOR_PREFILL_TOKENS_PER_S
        self.copy_bytes_per_s = _PRIOR_COPY_BYTES_PER_S

    def recompute_seconds(self, num_computed_tokens: int) -> float:
        return num_computed_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_computed_tokens: int) -> float:
        return 2 * num_computed_tokens * self.bytes_per_token / self.copy_bytes_per_s

    def prefers_swap(self, num_computed_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        return self.swap_seconds(num_computed_tokens) < self.recompute_seconds(num_computed_tokens)

    def observe_prefill(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step that computed `num_prefill_tokens` prompt tokens took `seconds`."""
        if num_prefill_tokens >= _MIN_PREFILL_TOKENS_TO_MEASURE and seconds > 0:
            self.prefill_tokens_per_s = _smooth(
                self.prefill_tokens_per_s, num_prefill_tokens / seconds
            )

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= _MIN_COPY_BYTES_TO_MEASURE and seconds > 0:
            self.copy_bytes_per_s = _smooth(self.copy_bytes_per_s, num_bytes / seconds)


def _smooth(previous: float, measured: float) -> float:
    return (1 - _SMOOTHING) * previous + _SMOOTHING * measured
