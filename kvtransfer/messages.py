"""Messages on a KV transfer channel: msgpack maps with a `type` tag, nothing executable.

One channel joins a prefill sender (a DEALER socket) to a decode receiver (a ROUTER socket). A
frame sequence on it is `[header, *data]`: the header is one of the dataclasses below; only
`Data` carries a data frame (raw KV bytes), every other message carries none.

  prefill -> decode   Begin      may I write transfer T? (before its first write)
                      Data       KV bytes of some blocks and layers of T (zmq transport)
                      Written    those blocks and layers of T are now in your memory
                                 (shm and cuda_ipc transports: the sender copied them itself)
                                 Data and Written carry `pace_s`: how long the prefill step
                                 that filled those blocks took, which paces T's deadline
                                 (kvtransfer/ledger.py)
                      Abandon    the sender will never write T again (no copy of T is running)
  decode -> prefill   Grant      yes: T's destination blocks and the seconds left before its
                                 deadline
                      Refuse     no: T is unknown, finished, failed or granted to another sender
                      Ack        message `seq` was applied (frees the sender's in-flight window),
                                 and the seconds now left before T's deadline (each write
                                 that lands moves it: kvtransfer/ledger.py)
                      Reject     message `seq` was dropped, with the reason (T fails)
                      Committed  every block of every layer of T arrived
                      Cancel     T failed on the decode side (deadline or abort); reply Abandon

`decode_header` checks sizes and every field's type before building a message and raises
`KVProtocolError` on anything else; receivers log and drop such frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.wire.messages import build_message, encode, unpack_map

MAX_HEADER_BYTES = 1 << 20
MAX_TRANSFER_ID_CHARS = 256


class KVProtocolError(ValueError):
    """A header that is not msgpack, not a map, of unknown type, or with ill-typed fields."""


@dataclass(frozen=True)
class Begin:
    type: ClassVar[str] = "begin"
    transfer_id: str


@dataclass(frozen=True)
class Data:
    type: ClassVar[str] = "data"
    transfer_id: str
    seq: int
    block_ids: list[int]
    layer_start: int
    layer_end: int
    dtype: str
    nbytes: int
    pace_s: float = 0.0


@dataclass(frozen=True)
class Written:
    type: ClassVar[str] = "written"
    transfer_id: str
    seq: int
    block_ids: list[int]
    layer_start: int
    layer_end: int
    pace_s: float = 0.0


@dataclass(frozen=True)
class Abandon:
    type: ClassVar[str] = "abandon"
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Grant:
    type: ClassVar[str] = "grant"
    transfer_id: str
    block_ids: list[int]
    seconds_left: float


@dataclass(frozen=True)
class Refuse:
    type: ClassVar[str] = "refuse"
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Ack:
    type: ClassVar[str] = "ack"
    transfer_id: str
    seq: int
    seconds_left: float


@dataclass(frozen=True)
class Reject:
    type: ClassVar[str] = "reject"
    transfer_id: str
    seq: int
    reason: str


@dataclass(frozen=True)
class Committed:
    type: ClassVar[str] = "committed"
    transfer_id: str


@dataclass(frozen=True)
class Cancel:
    type: ClassVar[str] = "cancel"
    transfer_id: str
    reason: str


MESSAGE_TYPES: dict[str, type] = {
    cls.type: cls
    for cls in (Begin, Data, Written, Abandon, Grant, Refuse, Ack, Reject, Committed, Cancel)
}


encode_header = encode  # the same tagged-map encoding as the node protocol


def decode_header(data: bytes | memoryview) -> Any:
    fields = unpack_map(data, MAX_HEADER_BYTES, "header", KVProtocolError)
    cls = MESSAGE_TYPES.get(fields.pop("type", None))
    if cls is None:
        raise KVProtocolError("header has no known message type")
    message = build_message(cls, fields, _matches, KVProtocolError)
    transfer_id = message.transfer_id
    if not transfer_id or len(transfer_id) > MAX_TRANSFER_ID_CHARS:
        raise KVProtocolError(
            f"transfer id has {len(transfer_id)} characters; expected 1-{MAX_TRANSFER_ID_CHARS}"
        )
    return message


def _matches(value: Any, annotation: str) -> bool:
    """Checks a value against this module's (string) annotations; numbers must be >= 0."""
    if annotation == "str":
        return isinstance(value, str)
    if annotation == "int":
        return _is_count(value)
    if annotation == "float":  # only durations: finite and >= 0
        return (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0
        )
    if annotation == "list[int]":
        return isinstance(value, list) and all(_is_count(v) for v in value)
    return False


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
