"""The client's direct controls over the next-token distribution: presence, frequency and
repetition penalties, min_p, logit_bias and stop_token_ids. Bounded here, where they enter
(a 400 naming the field), and passed on as SamplingParams arguments; the engine's sampler
applies them (engine/sample/logits_processors.py) and checks them again.

logit_bias keys are token ids written as JSON strings ("50256"); they are checked as integers
in the vocabulary and sent on as canonical strings (msgpack maps on the wire have string keys),
so "07" and "7" are the same id, and naming one id twice is a 400.
"""

from __future__ import annotations

import math
from typing import Any

from pdserve.router.errors import invalid
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.wire.limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MIN_PENALTY,
)

Request = CompletionRequest | ChatCompletionRequest


def _finite(value: float | None, param: str, low: float, high: float, rule: str) -> None:
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise invalid(f"'{param}' must be {rule}.", param)


def check_logit_controls(req: Request) -> None:
    """The bounds that need no vocabulary."""
    for name in ("presence_penalty", "frequency_penalty"):
        _finite(getattr(req, name), name, MIN_PENALTY, MAX_PENALTY, "between -2 and 2")
    penalty = req.repetition_penalty
    if penalty is not None and not (math.isfinite(penalty) and 0 < penalty):
        raise invalid("'repetition_penalty' must be greater than 0.", "repetition_penalty")
    _finite(penalty, "repetition_penalty", 0, MAX_REPETITION_PENALTY, "in (0, 2]")
    _finite(req.min_p, "min_p", 0.0, 1.0, "between 0 and 1")
    if req.logit_bias is not None and len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(
            f"'logit_bias' may bias at most {MAX_LOGIT_BIAS_ENTRIES:,} tokens.", "logit_bias"
        )
    for bias in (req.logit_bias or {}).values():
        _finite(bias, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "values between -100 and 100")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(
            f"'stop_token_ids' accepts at most {MAX_STOP_TOKEN_IDS:,} ids.", "stop_token_ids"
        )


def logit_control_params(req: Request, vocab_size: int) -> dict[str, Any]:
    """The SamplingParams arguments, token ids checked against the vocabulary."""
    params: dict[str, Any] = {}
    for name, neutral in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("min_p", 0.0),
    ):
        value = getattr(req, name)
        if value is not None and value != neutral:
            params[name] = float(value)
    if req.logit_bias:
        params["logit_bias"] = _canonical_biases(req.logit_bias, vocab_size)
    if req.stop_token_ids:
        if any(not 0 <= t < vocab_size for t in req.stop_token_ids):
            raise invalid(
                f"'stop_token_ids' entries must be token ids in [0, {vocab_size}).",
                "stop_token_ids",
            )
        params["stop_token_ids"] = list(req.stop_token_ids)
    return params


def _canonical_biases(biases: dict[str, float], vocab_size: int) -> dict[str, float]:
    canonical: dict[str, float] = {}
    for key, bias in biases.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid("'logit_bias' keys must be token ids, e.g. \"50256\".", "logit_bias")
        token_id = int(key)
        if token_id >= vocab_size:
            raise invalid(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}).", "logit_bias"
            )
        if str(token_id) in canonical:
            raise invalid("'logit_bias' names a token id twice.", "logit_bias")
        canonical[str(token_id)] = float(bias)
    return canonical
