"""Wire messages between the router and the nodes: msgpack maps, nothing executable.

Every message is a small dataclass with a `type` tag. `encode(message) -> bytes` packs its
fields (nested messages and NodeStats' parts as maps, SamplingParams as its wire map);
`decode(data) -> message` unpacks with size limits, looks the tag up, and checks every field's
type before constructing the dataclass, building its nested messages, its parts and its
SamplingParams (checked as at construction) the same way, raising `ProtocolError` on anything
malformed or unknown (receivers log and drop such messages; they never crash on them).

Flows, colocated mode:
  router -> node     Generate, Abort
  node -> router     TokenBatch (after every engine step that produced tokens), PromptProgress
                     (after every step that computed a chunk of a prompt without finishing it),
                     RequestFailed,
                     NodeStats (between engine steps, every heartbeat interval, in typed
                     parts: wire/node_stats.py; with its `identity.listen_address` it registers
                     a node the router did not know; a new `identity.instance_id` under a known
                     node id means the node was restarted; `kv.num_leaked_blocks` is the
                     node's idle-time block leak check),
                     Heartbeat (every heartbeat interval from a thread of its own, during long
                     engine steps too); either one tells the router the node is alive
Disaggregated mode adds:
  router -> decode   Generate with `prefill_address`: reserve blocks, then ask that prefill node
  router -> prefill  Abort (the router aborts a request on both nodes)
  decode -> prefill  PrefillRequest (prompt, sampling, the reserved target blocks, the decode
                     node's KV descriptor, seconds left before the transfer's deadline)
  prefill -> router  TokenBatch with the first token (offset 0), PromptProgress, RequestFailed,
                     NodeStats
  prefill -> decode  PrefillDone (the first token) once the prompt's last chunk has been written
  decode -> router   TokenBatch with the following tokens (offsets from 1), RequestFailed
Token updates carry their `offset` among the request's output tokens, so the router restores
their order when the first token (from the prefill node) and the rest (from the decode node)
arrive over different connections.
n > 1 choices of one prompt travel as ONE Generate (and one PrefillRequest, one PrefillDone,
one KV transfer) whose `choices` give each choice its own id and sampling: the prompt is
computed once under the message's `request_id` and forked (engine/forks.py); every other
message (TokenUpdate, RequestFailed, Abort) is about one choice, by its id. Without `choices`
a message is about one request, as it always was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from pdserve.wire.limits import MAX_CHOICES_PER_PROMPT
from pdserve.wire.node_stats import (
    NODE_STATS_PARTS,
    KvCacheStats,
    KvTransferTotals,
    NodeIdentity,
    SchedulingStats,
    TokenTotals,
)
from pdserve.wire.sampling_params import SamplingError, SamplingParams

MAX_MESSAGE_BYTES = 64 << 20


class ProtocolError(ValueError):
    """A message that is not valid msgpack, has an unknown type, or has ill-typed fields."""


class InvalidRequest(ProtocolError):
    """A well-formed request message whose sampling settings fail their checks: the receiver
    answers `request_id` with a 400 (RequestFailed) instead of dropping it silently."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass
class Choice:
    """One of n choices of a prompt: the id its tokens and failures travel under, and its
    own sampling settings."""

    request_id: str
    sampling: SamplingParams


@dataclass
class ChoiceToken:
    """A choice's first token, sampled by the prefill node."""

    request_id: str
    token_id: int
    logprobs: list[Any] | None = None


@dataclass
class Generate:
    """Start a request, sampled by `sampling`. With
    `prefill_address` (to a decode node), that prefill node computes the prompt. Lower
    `priority` is served first (engine.sched.sequence_queue). With `choices` (2 to
    MAX_CHOICES_PER_PROMPT), the prompt is computed once under `request_id` with `sampling`
    (the first choice's) and forked into the choices, each sampled with its own settings.
    `group` names the client request the prompt belongs to: the engine's fair share counts
    the sequences of one group together (engine/sched/request_share.py)."""

    type: ClassVar[str] = "generate"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_address: str | None = None
    priority: int = 0
    choices: list[Choice] = field(default_factory=list)
    group: str | None = None


@dataclass
class PrefillRequest:
    """Decode node -> prefill node: compute this prompt's KV into `dst_block_ids` of the decode
    node described by `kv_descriptor`, within `deadline_s` seconds; send the first token to the
    router and PrefillDone to `decode_address`."""

    type: ClassVar[str] = "prefill_request"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    dst_block_ids: list[int]
    decode_address: str
    kv_descriptor: bytes
    deadline_s: float
    priority: int = 0
    choices: list[Choice] = field(default_factory=list)
    group: str | None = None  # as Generate's


@dataclass
class PrefillDone:
    """Prefill node -> decode node: the prompt is computed (every block written) and this is
    its first token. With `choices`: one first token per choice the prefill node sampled (a
    choice aborted there has none), and `token_id` is -1."""

    type: ClassVar[str] = "prefill_done"
    request_id: str
    token_id: int
    logprobs: list[Any] | None = None
    num_cached_tokens: int = 0
    choices: list[ChoiceToken] = field(default_factory=list)


@dataclass
class Abort:
    type: ClassVar[str] = "abort"
    request_id: str


@dataclass
class TokenUpdate:
    """New tokens of one request. `logprobs` holds one [token_id, logprob, [[id, lp], ...]]
    entry per new token when the request asked for them; `finish_reason` ends the request;
    `num_cached_tokens` counts the prompt tokens served from the prefix cache; `offset` is the
    index of this update's first token among the request's output tokens. `prompt_logprobs`,
    with the first token (offset 0) of a request that asked, holds one
    [token_id, logprob, rank, [[id, lp], ...]] entry per prompt token after the first; such an
    update travels in a TokenBatch of its own, so one prompt's scores bound the message
    (wire/limits.py: MAX_PROMPT_LOGPROBS_TOKENS)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    logprobs: list[list[Any]] | None = None
    num_cached_tokens: int = 0
    offset: int = 0
    prompt_logprobs: list[list[Any]] | None = None


@dataclass
class TokenBatch:
    type: ClassVar[str] = "token_batch"
    node_id: str
    updates: list[TokenUpdate] = field(default_factory=list)


@dataclass
class PromptProgress:
    """Node -> router: how many prompt tokens (beyond the prefix cache's) are computed so far,
    by request id, for the prompts a step advanced without finishing. A request being
    prefilled is being served, not waiting (router/cluster/queue_delay.py)."""

    type: ClassVar[str] = "prompt_progress"
    node_id: str
    computed: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestFailed:
    """The node refused or lost a request; `status` is the HTTP status the router answers."""

    type: ClassVar[str] = "request_failed"
    request_id: str
    message: str
    status: int = 400


@dataclass
class NodeStats:
    """Node -> router, between engine steps and every heartbeat interval: the node's state in
    typed parts, each from one producer (wire/node_stats.py). A role without generation or KV
    transfers sends those parts' zero defaults."""

    type: ClassVar[str] = "node_stats"
    identity: NodeIdentity
    scheduling: SchedulingStats
    kv: KvCacheStats
    tokens: TokenTotals = field(default_factory=TokenTotals)
    kv_transfer: KvTransferTotals = field(default_factory=KvTransferTotals)


@dataclass
class Heartbeat:
    """Node -> router: this process (`instance_id`) of node `node_id` is alive."""

    type: ClassVar[str] = "heartbeat"
    node_id: str
    instance_id: str


MESSAGE_TYPES: dict[str, type] = {
    cls.type: cls
    for cls in (
        Heartbeat,
        Generate,
        Abort,
        TokenBatch,
        PromptProgress,
        RequestFailed,
        NodeStats,
        PrefillRequest,
        PrefillDone,
    )
}


def encode(message: Any) -> bytes:
    fields = _wire_map(message)
    fields["type"] = message.type
    return msgpack.packb(fields, use_bin_type=True)


def _wire_map(message: Any) -> dict[str, Any]:
    return {f.name: _wire_value(getattr(message, f.name)) for f in dataclasses.fields(message)}


def _wire_value(value: Any) -> Any:
    if isinstance(value, SamplingParams):
        return value.to_wire()
    if type(value) in _PARTS.values():
        return _wire_map(value)
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return [_wire_map(item) for item in value]
    return value


def unpack_map(
    data: bytes | memoryview,
    max_bytes: int,
    what: str,
    error: type[ValueError] = ProtocolError,
) -> dict[str, Any]:
    """Decodes one msgpack map of at most `max_bytes` (string keys only, nothing executable);
    raises `error` naming `what` for anything else. Every wire format of the project starts
    here."""
    if len(data) > max_bytes:
        raise error(f"{what} of {len(data):,} bytes exceeds {max_bytes:,}")
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as failure:  # noqa: BLE001 (msgpack raises several unrelated types)
        raise error(f"{what} is not msgpack: {type(failure).__name__}") from None
    if not isinstance(fields, dict):
        raise error(f"{what} is a msgpack {type(fields).__name__}, not a map")
    return fields


def decode(data: bytes) -> Any:
    fields = unpack_map(data, MAX_MESSAGE_BYTES, "message")
    cls = MESSAGE_TYPES.get(fields.pop("type", None))
    if cls is None:
        raise ProtocolError("unknown message type")
    try:
        return _build(cls, fields)
    except SamplingError as error:
        request_id = fields.get("request_id")
        if isinstance(request_id, str):
            raise InvalidRequest(str(error), request_id) from None
        raise ProtocolError(f"{cls.__name__}: {error}") from None


# Nested messages, by their field's annotation: the message and the most a list may hold.
_NESTED: dict[str, tuple[type, int | None]] = {
    "list[TokenUpdate]": (TokenUpdate, None),
    "list[Choice]": (Choice, MAX_CHOICES_PER_PROMPT),
    "list[ChoiceToken]": (ChoiceToken, MAX_CHOICES_PER_PROMPT),
}
# Nested parts, one map each, by their field's annotation (NodeStats' parts).
_PARTS: dict[str, type] = {part.__name__: part for part in NODE_STATS_PARTS}


def _build(cls: type, fields: Any) -> Any:
    """`build_message` after building the map's nested messages, parts and sampling settings."""
    if isinstance(fields, dict):
        for spec in dataclasses.fields(cls):
            value = fields.get(spec.name)
            if spec.type == "SamplingParams" and spec.name in fields:
                fields[spec.name] = _sampling(cls, value)
            elif spec.type in _PARTS and spec.name in fields:
                fields[spec.name] = _build(_PARTS[spec.type], value)
            elif spec.type in _NESTED and isinstance(value, list):
                nested, most = _NESTED[spec.type]
                if most is not None and len(value) > most:
                    raise ProtocolError(
                        f"{cls.__name__} has {len(value)} {spec.name}; at most {most}"
                    )
                fields[spec.name] = [_build(nested, item) for item in value]
    return build_message(cls, fields)


def _sampling(cls: type, value: Any) -> SamplingParams:
    try:
        return SamplingParams.from_wire(value)
    except SamplingError:
        raise
    except (ValueError, TypeError) as error:  # construction's own TypeError (say, a list key)
        raise SamplingError("sampling", f"is not valid: {error}", subject="") from None


_SCALARS = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes}


def build_message(
    cls: type,
    fields: Any,
    matches: Callable[[Any, str], bool] | None = None,
    error: type[ValueError] = ProtocolError,
) -> Any:
    """`cls(**fields)` once `fields` is a map of `cls`'s fields only, with every field that has
    no default, each value matching its field's (string) annotation by `matches` (default: this
    module's types); raises `error` naming the field otherwise. The one check of every tagged
    map on the project's wires (kvtransfer's headers pass their own `matches` and error)."""
    matches = matches or _matches
    if not isinstance(fields, dict):
        raise error(f"{cls.__name__} must be a map")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(known)
    if unknown:
        raise error(f"{cls.__name__} has unknown fields {sorted(unknown)}")
    for name, spec in known.items():
        if name not in fields:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise error(f"{cls.__name__} lacks field {name!r}")
            continue
        if not matches(fields[name], spec.type):
            raise error(f"{cls.__name__}.{name} is not a valid {spec.type}")
    return cls(**fields)


def _matches(value: Any, annotation: str) -> bool:
    """Checks a value against this module's (string) annotations."""
    if annotation.endswith(" | None"):
        return value is None or _matches(value, annotation[: -len(" | None")])
    if annotation in _SCALARS:
        expected = _SCALARS[annotation]
        if expected is not bool and isinstance(value, bool):
            return False
        if expected is float:
            return isinstance(value, (int, float))
        return isinstance(value, expected)
    if annotation == "list[int]":
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    if annotation == "SamplingParams":
        return isinstance(value, SamplingParams)
    if annotation in _PARTS:
        return isinstance(value, _PARTS[annotation])
    if annotation.startswith("list["):
        return isinstance(value, list)
    if annotation.startswith("dict["):
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return False
