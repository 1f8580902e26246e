"""Per-request sampling settings, the typed sampling contract of the wire: checked once, at
construction, so that whatever reaches a sampler fits its tensors. The router builds them from
a client's request (a `SamplingError` names the field for its 400), the wire carries them
(`to_wire`, `from_wire`: a msgpack map of these fields), and each node gets them decoded and
checked with its message: a node is safe with or without the router in front."""

from __future__ import annotations

import dataclasses
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
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from pdserve.wire.structured_output import check_structured_output


class SamplingError(ValueError):
    """A sampling setting out of its range or of the wrong type: `field` is its SamplingParams
    field (the router names the request's parameter from it), `subject` what the rule is about
    (the field, or a part of it: "a logit_bias token id"), `rule` what it must be, `got` (cut
    short) what it was, when that says more than the rule."""

    def __init__(
        self, field: str, rule: str, got: str | None = None, subject: str | None = None
    ) -> None:
        self.field = field
        self.rule = rule
        self.subject = field if subject is None else subject
        text = f"{self.subject} {rule}" if self.subject else rule
        super().__init__(text + (f", got {got}" if got is not None else ""))


def _integer(name: str, value: Any, low: int, high: int, field: str | None = None) -> int:
    """`value` as an int in [low, high] (numpy integers welcome); SamplingError otherwise."""
    field = field or name
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise SamplingError(field, "must be an integer", type(value).__name__, name) from None
    if not low <= number <= high:
        raise SamplingError(field, f"must be between {low:,} and {high:,}", _short(number), name)
    return number


def _real(name: str, value: Any, field: str | None = None) -> float:
    """`value` as a finite float; SamplingError for anything else (bools, strings, NaN, inf)."""
    field = field or name
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(field, "must be a number", type(value).__name__, name)
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        raise SamplingError(field, "must be a finite number", _short(value), name) from None
    if not math.isfinite(number):
        raise SamplingError(field, "must be a finite number", str(number), name)
    return number


def _logit_bias(value: Any) -> dict[int, float]:
    """`value` as {token id: bias}. Keys are ints or strings of digits: JSON object keys are
    strings, and so are the wire's (its msgpack maps take string keys only), so the router
    passes a client's map through as it came and the conversion happens here, once."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SamplingError(
            "logit_bias", "must be a map of token ids to biases", type(value).__name__
        )
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingError(
            "logit_bias", f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries", f"{len(value):,}"
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            if not (key.isascii() and key.isdigit() and len(key) <= 20):
                raise SamplingError(
                    "logit_bias",
                    "must be token ids (integers or strings of digits)",
                    _short(key),
                    "logit_bias keys",
                )
            key = int(key)
        token_id = _integer("a logit_bias token id", key, 0, INT32_MAX, "logit_bias")
        if token_id in biases:
            raise SamplingError("logit_bias", f"names token id {token_id} twice")
        name = f"logit_bias[{token_id}]"
        biases[token_id] = _in_range(name, bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "logit_bias")
    return biases


def _in_range(name: str, value: Any, low: float, high: float, field: str | None = None) -> float:
    """`value` as a float in [low, high]; SamplingError naming `name`, the value and the range."""
    number = _real(name, value, field)
    if not low <= number <= high:
        raise SamplingError(
            field or name, f"must be between {low:g} and {high:g}", str(number), name
        )
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
    end-of-sequence ids (at most 1,024 of them), which `ignore_eos` disables; neither can
    stop before `min_tokens`. Every count is at most 2**31 - 1, so it
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
            raise SamplingError(
                "min_tokens",
                f"must be between 0 and max_tokens ({self.max_tokens:,})",
                f"{self.min_tokens:,}",
            )
        self.temperature = _real("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(
                "temperature", f"must be between 0 and {MAX_TEMPERATURE:g}", str(self.temperature)
            )
        if self.temperature < GREEDY_TEMPERATURE_BELOW:
            self.temperature = 0.0
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", "must be in (0, 1]", str(self.top_p))
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
                raise SamplingError(flag, "must be true or false", type(value).__name__)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingError("stop", "must be a string or a list of strings")
        self.stop = [s for s in stop if s]
        stop_ids = self.stop_token_ids or []
        if not isinstance(stop_ids, (list, tuple)):
            raise SamplingError("stop_token_ids", "must be a list", type(stop_ids).__name__)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(
                "stop_token_ids",
                f"must have at most {MAX_STOP_TOKEN_IDS:,} ids",
                f"{len(stop_ids):,}",
            )
        self.stop_token_ids = [
            _integer("a stop_token_ids entry", t, 0, INT32_MAX, "stop_token_ids") for t in stop_ids
        ]
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _in_range(name, getattr(self, name), MIN_PENALTY, MAX_PENALTY))
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise SamplingError(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}]",
                str(self.repetition_penalty),
            )
        self.logit_bias = _logit_bias(self.logit_bias)
        self.min_p = _in_range("min_p", self.min_p, 0.0, 1.0)
        try:
            self.structured_output = check_structured_output(self.structured_output)
        except SamplingError:
            raise
        except ValueError as error:
            raise SamplingError("structured_output", str(error), subject="") from None

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map of these settings (its maps take string keys: logit_bias's token
        ids are written as strings of digits, which construction reads back)."""
        fields = dataclasses.asdict(self)
        fields["logit_bias"] = {str(token_id): bias for token_id, bias in self.logit_bias.items()}
        return fields

    @classmethod
    def from_wire(cls, fields: Any) -> SamplingParams:
        """Settings from their wire map, checked as at construction; SamplingError for a map
        that is not one of them."""
        if not isinstance(fields, dict):
            raise SamplingError("sampling", "must be a map", subject="sampling settings")
        unknown = set(fields) - _FIELD_NAMES
        if unknown:
            raise SamplingError(
                "sampling", f"has unknown fields {sorted(unknown)[:8]}", subject="a sampling map"
            )
        return cls(**fields)

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


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
