"""Transport names -> the receiver and sender halves that implement them."""

from __future__ import annotations

from kvtransfer.transports.base import ReceiverTransport, SenderTransport
from kvtransfer.transports.cuda_ipc import CudaIpcReceiverTransport, CudaIpcSenderTransport
from kvtransfer.transports.shm import ShmReceiverTransport, ShmSenderTransport
from kvtransfer.transports.zmq_tcp import ZmqReceiverTransport, ZmqSenderTransport

TRANSPORT_NAMES = ("shm", "cuda_ipc", "zmq")


def _check_name(name: str) -> None:
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"unknown KV transport {name!r}; valid transports: {list(TRANSPORT_NAMES)}")


def receiver_transport(name: str, node_id: str) -> ReceiverTransport:
    _check_name(name)
    if name == "shm":
        return ShmReceiverTransport(node_id)
    if name == "cuda_ipc":
        return CudaIpcReceiverTransport(node_id)
    return ZmqReceiverTransport(node_id)


def sender_transport(name: str, staging_bytes: int) -> SenderTransport:
    _check_name(name)
    if name == "shm":
        return ShmSenderTransport()
    if name == "cuda_ipc":
        return CudaIpcSenderTransport()
    return ZmqSenderTransport(staging_bytes)
