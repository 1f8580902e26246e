"""Which cure a preempted sequence gets: recompute (drop its KV, prefill it again later) or swap
(copy its KV to host memory and back).

`mode` "recompute" and "swap" are fixed choices ("swap" falls back to recompute when the swap
space is full). "auto" compares, per sequence, the time each cure is expected to cost:
  recompute: its computed tokens / the measured prefill speed (tokens per second);
  swap:      its KV bytes, out and back in / the measured host-copy bandwidth.
Both speeds start at a prior; the first measurement replaces it and later ones follow an
exponential moving average of what the engine measures (`observe_prefill`, `observe_copy`),
so the choice adapts to the device. The measured prefill speed is also what the node reports
to the router, which turns queued prompt tokens into a queue delay (router/cluster/queue_delay.py).
A measured step's time includes its device work: on CUDA, where kernels run asynchronously to
the host, the engine waits for the device before it reads the clock (only for the steps
`measures_prefill` accepts, so nothing else pays for the wait).
"""

from __future__ import annotations

PREEMPTION_MODES = ("auto", "recompute", "swap")

_PRIOR_PREFILL_TOKENS_PER_S = 2_000.0
_PRIOR_COPY_BYTES_PER_S = 4e9
_SMOOTHING = 0.2
_MIN_PREFILL_TOKENS_TO_MEASURE = 64
_MIN_COPY_BYTES_TO_MEASURE = 1 << 20


class PreemptionPolicy:
    def __init__(
        self, mode: str, bytes_per_token: int, max_num_batched_tokens: int | None = None
    ) -> None:
        """Steps with fewer prompt tokens than `_MIN_PREFILL_TOKENS_TO_MEASURE` (or than the
        step budget, `max_num_batched_tokens`, when that is smaller) are not measured."""
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.bytes_per_token = bytes_per_token
        self.prefill_tokens_per_s = _PRIOR_PREFILL_TOKENS_PER_S
        self.copy_bytes_per_s = _PRIOR_COPY_BYTES_PER_S
        self.prefill_measured = False
        self.min_prefill_tokens_to_measure = min(
            _MIN_PREFILL_TOKENS_TO_MEASURE, max_num_batched_tokens or _MIN_PREFILL_TOKENS_TO_MEASURE
        )
        self.copy_measured = False

    @property
    def measured_prefill_tokens_per_s(self) -> float:
        """The measured prefill speed; 0.0 until a step has measured one."""
        return self.prefill_tokens_per_s if self.prefill_measured else 0.0

    def recompute_seconds(self, num_computed_tokens: int) -> float:
        return num_computed_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_computed_tokens: int) -> float:
        return 2 * num_computed_tokens * self.bytes_per_token / self.copy_bytes_per_s

    def prefers_swap(self, num_computed_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        return self.swap_seconds(num_computed_tokens) < self.recompute_seconds(num_computed_tokens)

    def measures_prefill(self, num_prefill_tokens: int) -> bool:
        """Whether a step with `num_prefill_tokens` prompt tokens is measured: only then does
        the engine wait for the device to finish the step (CUDA) before reading the clock."""
        return num_prefill_tokens >= self.min_prefill_tokens_to_measure

    def observe_prefill(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step that computed `num_prefill_tokens` prompt tokens took `seconds`, its device
        work included."""
        if self.measures_prefill(num_prefill_tokens) and seconds > 0:
            measured = num_prefill_tokens / seconds
            self.prefill_tokens_per_s = (
                _smooth(self.prefill_tokens_per_s, measured) if self.prefill_measured else measured
            )
            self.prefill_measured = True

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= _MIN_COPY_BYTES_TO_MEASURE and seconds > 0:
            measured = num_bytes / seconds
            self.copy_bytes_per_s = (
                _smooth(self.copy_bytes_per_s, measured) if self.copy_measured else measured
            )
            self.copy_measured = True


def _smooth(previous: float, measured: float) -> float:
    return (1 - _SMOOTHING) * previous + _SMOOTHING * measured
