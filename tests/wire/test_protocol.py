"""Wire messages round-trip through msgpack, and anything malformed is refused, not obeyed."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.wire.limits import MAX_CHOICES_PER_PROMPT
from pdserve.wire.messages import (
    Abort,
    Choice,
    ChoiceToken,
    Generate,
    InvalidRequest,
    NodeStats,
    PrefillDone,
    ProtocolError,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
    decode,
    encode,
)
from pdserve.wire.node_stats import (
    KvCacheStats,
    KvTransferTotals,
    NodeIdentity,
    SchedulingStats,
    TokenTotals,
)
from pdserve.wire.sampling_params import SamplingParams

MESSAGES = [
    Generate(
        "r1",
        [1, 2, 3],
        SamplingParams(temperature=0.0, max_tokens=4, logit_bias={7: -1.5}, stop=["\n"]),
    ),
    Abort("r1"),
    TokenBatch("n0", [TokenUpdate("r1", [5], None, 3, [[5, -0.5, [[5, -0.5], [7, -1.0]]]])]),
    RequestFailed("r1", "token id 900 is outside the vocabulary", 400),
    NodeStats(
        NodeIdentity("n0", "colocated", 8192, 49152, instance_id="i0", block_size=16),
        SchedulingStats(1, 2, 0, queue_wait_seconds_by_priority={"0": 0.5}),
        KvCacheStats(30, 100, num_cached_blocks=4),
        TokenTotals(17, 40),
        KvTransferTotals(bytes_total=1 << 20, seconds_total=0.25),
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.type)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"type": "no-such-type"}),
        msgpack.packb({"request_id": "r1"}),
        msgpack.packb({"type": "abort"}),
        msgpack.packb({"type": "abort", "request_id": 5}),
        msgpack.packb({"type": "abort", "request_id": "r1", "extra": 1}),
        msgpack.packb({"type": "generate", "request_id": "r", "prompt_token_ids": [1, True],
                       "sampling": {}}),
        msgpack.packb({"type": "generate", "request_id": "r", "prompt_token_ids": [1],
                       "sampling": {1: 2}}),
        msgpack.packb({"type": "token_batch", "node_id": "n", "updates": [{"token_ids": [1]}]}),
    ],
)
def test_malformed_messages_raise_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode(payload)


def test_node_stats_parts_are_checked_like_messages():
    """NodeStats' parts travel as nested maps, each checked field by field: a part that is not
    a map, lacks a required field, has an unknown one or an ill-typed value is refused."""
    stats = msgpack.unpackb(encode(MESSAGES[-1]))
    assert isinstance(stats["kv"], dict) and stats["kv"]["num_free_blocks"] == 30

    def with_part(name: str, part) -> bytes:
        return msgpack.packb({**stats, name: part})

    for payload, refusal in [
        (with_part("kv", 30), "KvCacheStats must be a map"),
        (with_part("identity", {**stats["identity"], "role": None}), "NodeIdentity.role"),
        (with_part("scheduling", {"num_waiting": 0, "num_running": 0}), "num_preemptions"),
        (with_part("tokens", {"prompt_total": 1, "extra": 2}), "unknown fields"),
        (with_part("kv_transfer", {"bytes_total": 1.5}), "KvTransferTotals.bytes_total"),
        (with_part("kv", {**stats["kv"], "num_free_blocks": True}), "num_free_blocks"),
        (msgpack.packb({k: v for k, v in stats.items() if k != "identity"}), "identity"),
    ]:
        with pytest.raises(ProtocolError, match=refusal):
            decode(payload)
    lean = {k: v for k, v in stats.items() if k not in ("tokens", "kv_transfer")}
    assert decode(msgpack.packb(lean)).kv_transfer == KvTransferTotals()  # a role without any


def test_pickle_payloads_are_not_messages():
    import pickle

    with pytest.raises(ProtocolError):
        decode(pickle.dumps(Abort("r1")))


def test_the_longest_scored_prompt_with_twenty_alternatives_fits_one_message():
    from pdserve.wire.limits import MAX_LOGPROBS, MAX_PROMPT_LOGPROBS_TOKENS
    from pdserve.wire.messages import MAX_MESSAGE_BYTES, TokenBatch, TokenUpdate, decode, encode

    worst = [150_000, -12.345678901234, 150_000, [[150_000, -0.123456789]] * MAX_LOGPROBS]

    def message(num_positions: int) -> bytes:
        update = TokenUpdate("r", [1], prompt_logprobs=[worst] * num_positions)
        return encode(TokenBatch("n0", [update]))

    per_position = len(message(1001)) - len(message(1000))
    assert per_position <= 323  # as wire/limits.py states
    header_growth = 4  # an array past 65,535 entries has a 5-byte header, not 3
    longest = len(message(0)) + header_growth + per_position * (MAX_PROMPT_LOGPROBS_TOKENS - 1)
    assert longest <= MAX_MESSAGE_BYTES
    assert decode(message(3)).updates[0].prompt_logprobs[-1] == worst


def test_choices_round_trip_typed_and_bounded():
    choices = [Choice(f"c{i}", SamplingParams(seed=5 + i, max_tokens=4)) for i in range(3)]
    generate = decode(encode(Generate("p", [1, 2], choices[0].sampling, choices=choices)))
    assert generate.choices == choices and isinstance(generate.choices[0], Choice)
    done = decode(encode(PrefillDone("p", -1, choices=[ChoiceToken("c0", 9, None)])))
    assert done.choices == [ChoiceToken("c0", 9, None)]
    assert decode(encode(Generate("r", [1], SamplingParams()))).choices == []  # one choice
    too_many = [Choice(f"c{i}", SamplingParams()) for i in range(MAX_CHOICES_PER_PROMPT + 1)]
    with pytest.raises(ProtocolError, match="choices"):
        decode(encode(Generate("p", [1], SamplingParams(), choices=too_many)))
    bad = msgpack.packb({"type": "generate", "request_id": "p", "prompt_token_ids": [1],
                         "sampling": {}, "choices": [{"request_id": 7, "sampling": {}}]})
    with pytest.raises(ProtocolError):
        decode(bad)


def test_sampling_travels_typed_and_is_checked_where_it_lands():
    """The settings arrive as SamplingParams, checked as at construction: a request whose
    settings fail (a peer that is not the router, or another version of it) raises
    InvalidRequest naming its id, so the node answers it with a 400 instead of dropping it."""
    sampling = SamplingParams(temperature=0.5, seed=3, logit_bias={"12": 2.0}, min_tokens=2)
    generate = decode(encode(Generate("r", [1], sampling)))
    assert isinstance(generate.sampling, SamplingParams) and generate.sampling == sampling
    assert generate.sampling.logit_bias == {12: 2.0}

    def generate_with(settings) -> bytes:
        return msgpack.packb({"type": "generate", "request_id": "bad", "prompt_token_ids": [1],
                              "sampling": settings})

    for settings, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"no_such_option": 1}, "no_such_option"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ([1, 2], "map"),
    ]:
        with pytest.raises(InvalidRequest, match=field) as refused:
            decode(generate_with(settings))
        assert refused.value.request_id == "bad"
    choice = {"request_id": "c0", "sampling": {"top_p": 0}}
    nested = msgpack.packb({"type": "generate", "request_id": "p", "prompt_token_ids": [1],
                            "sampling": {}, "choices": [choice]})
    with pytest.raises(InvalidRequest, match="top_p") as refused:
        decode(nested)
    assert refused.value.request_id == "p"


def test_every_setting_at_its_bound_crosses_the_wire():
    """SamplingParams bounds every number to what msgpack carries: the router never builds a
    message it cannot send."""
    from pdserve.wire.limits import INT32_MAX, MAX_LOGPROBS, SEED_MAX, SEED_MIN

    for seed in (SEED_MIN, SEED_MAX):
        sampling = SamplingParams(
            seed=seed, top_k=INT32_MAX, max_tokens=INT32_MAX, min_tokens=INT32_MAX,
            logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, stop_token_ids=[INT32_MAX],
            logit_bias={INT32_MAX: -100.0},
        )
        assert decode(encode(Generate("r", [INT32_MAX], sampling))).sampling == sampling
