"""The cluster secret: one shared secret gates every ZeroMQ link of a deployment (router <-> node,
node <-> node, the KV channel) with ZeroMQ's CURVE handshake, and encrypts what they carry.

Every process derives the same CURVE key pair from the secret (scrypt, slow on purpose: a
recorded handshake must not make a weak secret cheap to guess). Who calls what:
  `secure_server(socket)`  before bind: the router's PULL, each node's PULL, the KV receiver's
                           ROUTER. The socket is a CURVE server with the derived secret key.
  `secure_client(socket)`  before connect: a node's PUSH to the router, its heartbeat PUSH, its
                           PUSH to peer nodes, the router's PUSH to each node, the KV sender's
                           DEALER. The socket gets a fresh key pair and the derived public key
                           as the server's key.
The derived public key never travels on the wire, so a peer without the secret cannot complete
the handshake, which happens when it connects: it is disconnected before any message of it is
delivered, and a client learns that the server holds the secret too.
  `admin_token()`          the bearer token of the router's admin routes (router/api/admin.py),
                           which the launcher's planner calls over loopback HTTP: an HMAC of
                           the derived key, so it proves the secret without revealing it.

Without a secret (`ClusterAuth.none()`) sockets are left as they are: links in the clear, fit
for one host only. `check_addresses` refuses a non-loopback address then. The command lines
read `--cluster-secret` (or `PDSERVE_CLUSTER_SECRET`) once and pass a `ClusterAuth` down.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16
_KDF_SALT = b"pdserve cluster CURVE server key v1"
_KDF_COST = 1 << 14  # scrypt N: about 50 ms and 16 MiB, once per process
_ADMIN_TOKEN_LABEL = b"pdserve router admin token v1"


def check_secret(secret: str) -> None:
    """Raises ValueError for a secret too short to protect anything, or a libzmq without CURVE."""
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the cluster secret has {len(secret)} characters; expected at least "
            f"{MIN_SECRET_CHARS} (a random one: `openssl rand -hex 32`)"
        )
    if not zmq.has("curve"):
        raise ValueError(
            f"--cluster-secret needs ZeroMQ's CURVE security, which this libzmq "
            f"{zmq.zmq_version()} lacks (zmq.has('curve') is False); the pyzmq wheels have it"
        )


def is_loopback(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// addresses whose every host is a loopback one
    (127.0.0.0/8, ::1, localhost); a wildcard, a host name or an interface name is not."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or not rest:
        return False
    for endpoint in rest.split(";"):  # "tcp://SOURCE;HOST:PORT" names a source address too
        host = endpoint.rsplit(":", 1)[0].strip("[]")
        if host == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return True


@dataclass(frozen=True)
class ClusterAuth:
    """The CURVE keys derived from a cluster secret, or none (`enabled` False)."""

    server_secret_key: bytes | None = field(default=None, repr=False)
    server_public_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def none(cls) -> ClusterAuth:
        return cls()

    @classmethod
    def from_secret(cls, secret: str | None) -> ClusterAuth:
        """None: no secret, sockets left as they are."""
        if secret is None:
            return cls()
        check_secret(secret)
        seed = hashlib.scrypt(
            secret.encode(), salt=_KDF_SALT, n=_KDF_COST, r=8, p=1, dklen=32
        )
        secret_key = z85.encode(seed)
        return cls(secret_key, zmq.curve_public(secret_key))

    @property
    def enabled(self) -> bool:
        return self.server_secret_key is not None

    def admin_token(self) -> str | None:
        """The bearer token of the router's admin routes; None without a secret (the routes
        are then closed)."""
        if not self.enabled:
            return None
        return hmac.new(self.server_secret_key, _ADMIN_TOKEN_LABEL, hashlib.sha256).hexdigest()

    def secure_server(self, socket: zmq.Socket) -> zmq.Socket:
        """Call before bind()."""
        if self.enabled:
            socket.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret_key)
            socket.setsockopt(zmq.CURVE_SERVER, 1)
        return socket

    def secure_client(self, socket: zmq.Socket) -> zmq.Socket:
        """Call before connect()."""
        if self.enabled:
            public_key, secret_key = zmq.curve_keypair()
            socket.setsockopt(zmq.CURVE_SERVERKEY, self.server_public_key)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
            socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
        return socket

    def check_addresses(self, addresses: Iterable[tuple[str, str | None]]) -> None:
        """Without a secret, raises ValueError for the first address (paired with the flag that
        set it) that is not a loopback one: the links would be open to other hosts."""
        if self.enabled:
            return
        for flag, address in addresses:
            if address and not is_loopback(address):
                raise ValueError(
                    f"{flag} {address} is not a loopback address; links across hosts need "
                    f"--cluster-secret (or {SECRET_ENV}), the same on the router and every node"
                )
