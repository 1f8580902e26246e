"""Per-request sampling settings, checked once at construction so that whatever reaches the
sampler fits its tensors: a node is safe with or without the router's own checks in front."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any

from pdserve.wire.limits import (
    GREEDY_TEMPERATURE_BELOW,
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from pdserve.wire.structured_output import check_structured_output


def _integer(name: str, value: Any, low: int, high: int) -> int:
    """`value` as an int in [low, high] (numpy integers welcome); ValueError otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not low <= number <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {_short(number)}")
    return number


def _real(name: str, value: Any) -> float:
    """`value` as a finite float; ValueError for anything else (bools, strings, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")  # noqa: TRY004
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    return number


def _logit_bias(value: Any) -> dict[int, float]:
    """`value` as {token id: bias}. Keys are ints or strings of digits: JSON object keys are
    strings, and so are the wire's (its msgpack maps take string keys only), so the router
    passes a client's map through as it came and the conversion happens here, once."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 (every bad parameter is a ValueError)
            f"logit_bias must be a map of token ids to biases, got {type(value).__name__}"
        )
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value):,}"
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            if not (key.isascii() and key.isdigit() and len(key) <= 20):
                raise ValueError(
                    f"logit_bias keys must be token ids (integers or strings of digits), "
                    f"got {_short(key)}"
                )
            key = int(key)
        token_id = _integer("a logit_bias token id", key, 0, INT32_MAX)
        if token_id in biases:
            raise ValueError(f"logit_bias names token id {token_id} twice")
        name = f"logit_bias[{token_id}]"
        biases[token_id] = _in_range(name, bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return biases


def _in_range(name: str, value: Any, low: float, high: float) -> float:
    """`value` as a float in [low, high]; ValueError naming `name`, the value and the range."""
    number = _real(name, value)
    if not low <= number <= high:
        raise ValueError(f"{name} must be between {low:g} and {high:g}, got {number}")
    return number


def _short(value: Any) -> str:
    """A value for an error message, cut short (a client can send a 4,000-digit integer)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    return text if len(text) <= 40 else text[:40] + "..."


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Checked once, at construction.

    temperature 0 is greedy, and so is any temperature below 1e-5 (it is set to 0); at most
    100. top_k -1 (or 0) and top_p 1 disable those filters; a top_k beyond the vocabulary keeps
    the whole vocabulary. `seed` (signed 64-bit) makes a request's samples reproducible
    whatever else shares its batches. `logprobs` N returns the sampled token's log-probability
    and the N most likely alternatives (0 <= N <= 20); `prompt_logprobs` N the same for every
    prompt token after the first, given the tokens before it (engine/sample/prompt_logprobs.py).
    `stop` strings end the text before the match; `stop_token_ids` add to the model's own
    end-of-sequence ids, which `ignore_eos` disables; neither can stop before `min_tokens`. Every count is at most 2**31 - 1, so it
    fits any integer tensor; the engine checks token ids against the vocabulary.

    Penalties and biases (vLLM's semantics; engine/sample/logits_processors.py applies them, to greedy
    rows too): `presence_penalty` and `frequency_penalty` (each in [-2, 2], 0 is off) subtract
    presence * (count > 0) + frequency * count from each token's logit, counting the tokens
    generated so far; `repetition_penalty` (in (0, 2], 1 is off) divides the positive logits
    and multiplies the others of every token in the prompt or the output so far;
    `logit_bias` maps token ids (ints, or strings of digits as JSON sends them) to a bias in
    [-100, 100] added to the logit, at most 1,024 of them, and is always a dict[int, float]
    after construction. `min_p` (in [0, 1], 0 is off) drops, in random rows, the tokens whose
    probability after temperature is below min_p times the most likely one's.

    `structured_output` constrains the output to a JSON schema, any JSON object, a regex, one
    of a list of strings or a Lark grammar: a map with exactly one of the keys json_schema,
    json_object, regex, choice, grammar (wire/structured_output.py lists the forms and
    bounds). The grammar decides where such an output ends: it ends ("stop") as soon as the
    grammar is complete, even with `ignore_eos`, and `min_tokens` does not hold back the stop
    tokens the grammar allows.
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    structured_output: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1, INT32_MAX)
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )
        self.temperature = _real("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.temperature < GREEDY_TEMPERATURE_BELOW:
            self.temperature = 0.0
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = _integer("top_k", self.top_k, -1, INT32_MAX)
        self.top_k = -1 if top_k == 0 else top_k  # 0 disables it, as -1 does
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer(
                "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS
            )
        for flag in ("ignore_eos", "skip_special_tokens"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ValueError(  # noqa: TRY004 (every bad parameter is a ValueError)
                    f"{flag} must be true or false, got {type(value).__name__}"
                )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        self.stop = [s for s in stop if s]
        stop_ids = self.stop_token_ids or []
        if not isinstance(stop_ids, (list, tuple)):
            raise ValueError(  # noqa: TRY004 (every bad parameter is a ValueError)
                f"stop_token_ids must be a list, got {type(stop_ids).__name__}"
            )
        self.stop_token_ids = [
            _integer("a stop_token_ids entry", t, 0, INT32_MAX) for t in stop_ids
        ]
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _in_range(name, getattr(self, name), MIN_PENALTY, MAX_PENALTY))
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        self.logit_bias = _logit_bias(self.logit_bias)
        self.min_p = _in_range("min_p", self.min_p, 0.0, 1.0)
        self.structured_output = check_structured_output(self.structured_output)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the sampler then reads the sequence's token history)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
