"""KV transfer from prefill to decode nodes: shm, cuda_ipc, zmq and mooncake transports over one
channel.

See base.py for who calls what and when, strategies.py for who writes the bytes (direct write
or streamed), ledger.py for completion and the late-write rule.
"""

from __future__ import annotations

from pdserve.kvtransfer.base import (
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferEvent,
    TransferKind,
)
from pdserve.kvtransfer.descriptor import DescriptorMismatch, KVDescriptor
from pdserve.kvtransfer.outgoing import SenderConfig
from pdserve.kvtransfer.receiver import ChannelReceiver, ReceiverConfig
from pdserve.kvtransfer.sender import ChannelSender
from pdserve.kvtransfer.transports.registry import TRANSPORT_NAMES

__all__ = [
    "TRANSPORT_NAMES",
    "ChannelReceiver",
    "ChannelSender",
    "DescriptorMismatch",
    "KVDescriptor",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "ReceiverConfig",
    "SenderConfig",
    "TransferEvent",
    "TransferKind",
]
