from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Checked once, at construction.

    temperature 0 is greedy. top_k -1 (or 0) and top_p 1 disable those filters. `seed` makes a
    request's samples reproducible whatever else shares its batches. `logprobs` N returns the
    sampled token's log-probability and the N most likely alternatives (0 <= N <= 20).
    `stop` strings end the text before the match; `stop_token_ids` add to the model's own
    end-of-sequence ids, which `ignore_eos` disables; neither can stop before `min_tokens`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")  # noqa: TRY004
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
