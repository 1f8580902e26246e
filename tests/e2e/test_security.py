"""A default `pdserve serve` (router, prefill node, decode node as real processes) under hostile
input: every TCP socket any of its processes listens on is bound to 127.0.0.1; pickled
payloads, random bytes, malformed and well-formed messages sent to every ZeroMQ port (the
router's and the nodes' PULL sockets and the decode node's KV channel), raw and through
ZeroMQ sockets of every type that can connect, never arrive without the cluster secret; with it
they are dropped without being unpickled; every process stays up and keeps serving; with an
API key and --api-key-guards-every-route every route but the probes /health and /ping answers
401 without it (the default, vLLM's /v1/ rule, is tests/router/test_api_key_routes.py's)."""

from __future__ import annotations

import os
import pathlib
import pickle
import socket
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.commands.serve_process import ServeProcess
from pdserve.router.api.app import create_app
from pdserve.router.api.auth import ADMIN_PREFIX
from pdserve.router.config import RouterConfig
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.free_ports import free_port
from pdserve.wire.messages import Heartbeat, NodeStats, encode
from pdserve.wire.node_stats import KvCacheStats, NodeIdentity, SchedulingStats
from tests.fault_checks import wait_until

KEY = "test-key-4c1d"
CLUSTER_SECRET = "security-test-cluster-secret"
LISTEN = "0A"
HANDSHAKE_OUTCOMES = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)


class TouchOnUnpickle:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def process_tree(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket the processes hold."""
    inodes = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                address, port = local.split(":")
                found.append((inodes[inode], decode_address(address, width), int(port, 16)))
    return found


def decode_address(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    family = socket.AF_INET if width == 8 else socket.AF_INET6
    return socket.inet_ntop(family, words)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("security") / "serve.log"
    server = ServeProcess(
        ["--model", str(tiny_llama_dir), "--kv-cache-memory", str(32 << 20), "--api-key", KEY,
         "--api-key-guards-every-route", "--cluster-secret", CLUSTER_SECRET, "--disagg-policy", "always"],
        ready_timeout_s=120,
        log_path=log_path,
    )
    server.log_path = log_path
    server.model_name = tiny_llama_dir.name
    try:
        wait_until(  # the decode node binds its KV channel at start-up
            lambda: len(listening_sockets(process_tree(server.process.pid))) >= 5,
            60,
            "every process listening",
        )
        yield server
    finally:
        server.close()


def generate(server: ServeProcess) -> httpx.Response:
    body = {"model": server.model_name, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    return httpx.post(
        f"{server.url}/v1/completions", json=body, timeout=60,
        headers={"authorization": f"Bearer {KEY}"},
    )


def test_every_listening_socket_is_on_loopback(server):
    sockets = listening_sockets(process_tree(server.process.pid))
    # HTTP, the router's PULL, each node's PULL, the decode node's KV channel
    assert len(sockets) >= 5, sockets
    assert {address for _, address, _ in sockets} <= {"127.0.0.1", "::1"}, sockets


def node_stats(node_id: str) -> bytes:
    """A well-formed registration the router would log as refused (a foreign model)."""
    identity = NodeIdentity(
        node_id, "prefill", 64, 512,
        listen_address=f"tcp://127.0.0.1:{free_port()}", model_fingerprint=f"not-{node_id}",
        dtype="float32", block_size=16,
    )
    return encode(NodeStats(identity, SchedulingStats(0, 0, 0), KvCacheStats(0, 0)))


def send_everywhere(ports: list[int], payloads: list[bytes], auth: ClusterAuth) -> list[int]:
    """Each payload to each port: raw TCP, then through every ZeroMQ socket type that can
    connect, as a client with `auth`'s keys (none: a stranger to the cluster). Returns the
    handshake outcome of each ZeroMQ connection (a zmq.EVENT_HANDSHAKE_* value), each awaited:
    by then the port has judged the connection."""
    context = zmq.Context()
    outcomes = []
    events = 0
    for event in HANDSHAKE_OUTCOMES:
        events |= event
    try:
        for port in ports:
            address = f"tcp://127.0.0.1:{port}"
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(payloads[0] + os.urandom(2048))
            for kind in (zmq.PUSH, zmq.DEALER, zmq.REQ, zmq.PUB):
                sock = auth.secure_client(context.socket(kind))
                sock.setsockopt(zmq.LINGER, 200)
                sock.setsockopt(zmq.SNDTIMEO, 500)
                monitor = sock.get_monitor_socket(events)
                sock.connect(address)
                for payload in payloads:
                    try:
                        sock.send_multipart([payload, payload[:64]] if kind == zmq.DEALER
                                            else [payload])
                    except zmq.ZMQError:
                        pass  # a socket type the port refuses (or a REQ waiting for a reply)
                assert monitor.poll(30_000), f"port {port} never answered a handshake"
                outcomes.append(recv_monitor_message(monitor)["event"])
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close()
    finally:
        context.term()
    return outcomes


def test_pickles_and_garbage_on_every_zmq_port_are_dropped_and_the_nodes_keep_serving(
    server, tmp_path
):
    marker = tmp_path / "unpickled"
    zmq_ports = sorted({port for _, _, port in listening_sockets(
        process_tree(server.process.pid)) if port != server.port})
    assert len(zmq_ports) >= 4, zmq_ports
    payloads = [
        pickle.dumps(TouchOnUnpickle(marker)),
        os.urandom(4096),
        b"\x80\x05",  # a pickle protocol header alone
        msgpack.packb({"type": "generate", "request_id": 5, "prompt_token_ids": "x"}),
        msgpack.packb({"type": "abort"}),
        msgpack.packb([1, 2, 3]),
        os.urandom(1 << 20),
    ]

    # Without the cluster secret nothing arrives, not even well-formed messages.
    stranger = [*payloads, encode(Heartbeat("stranger", "0")), node_stats("stranger")]
    outcomes = send_everywhere(zmq_ports, stranger, ClusterAuth.none())
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in outcomes  # refused before any message passed
    assert server.process.poll() is None
    assert generate(server).status_code == 200
    log = server.log_path.read_text()
    assert "malformed" not in log and "unexpected heartbeat" not in log, log[-3000:]
    assert "stranger" not in log, log[-3000:]

    # With it, whatever a member sends is decoded only as msgpack, and garbage is dropped.
    member = [*payloads, encode(Heartbeat("member", "0")), node_stats("member")]
    outcomes = send_everywhere(zmq_ports, member, ClusterAuth.from_secret(CLUSTER_SECRET))
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED in outcomes
    expected_drops = (
        ("pdserve.router.cluster.node_client", len(payloads)),  # the router's PULL
        ("pdserve.node.runtime", 2 * len(payloads)),  # both nodes' PULL sockets
        ("pdserve.kvtransfer.receiver", len(payloads)),  # the decode node's KV channel
    )

    def drops(log: str) -> dict[str, int]:
        dropped = [line for line in log.splitlines() if "malformed" in line]
        return {where: sum(f"{where}: " in line for line in dropped) for where, _ in expected_drops}

    def all_handled() -> bool:
        log = server.log_path.read_text()
        counts = drops(log)
        return (
            "refused node member" in log
            and all(counts[where] >= count for where, count in expected_drops)
            and log.count("dropped an unexpected heartbeat message") >= 2  # both nodes
        )

    wait_until(all_handled, 60, "every member message handled by the router and both nodes")
    assert server.process.poll() is None
    assert all(Path(f"/proc/{pid}").exists() for pid in process_tree(server.process.pid))
    assert generate(server).status_code == 200
    assert not marker.exists(), "a pickled payload was unpickled"
    assert "stranger" not in server.log_path.read_text()


def test_every_route_but_the_probes_needs_the_api_key(server, tiny_llama_dir):
    app = create_app(RouterConfig(model_path=tiny_llama_dir, node_addresses=[]))
    routes = [(r.path, sorted(r.methods)) for r in app.routes if hasattr(r, "methods")]
    routes += [("/", ["GET"]), ("/v1/embeddings", ["POST"]), ("/docs", ["GET"])]
    assert {
        "/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/version", "/ping"
    } <= {path for path, _ in routes}
    for path, methods in routes:
        for method in methods:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
                response = httpx.request(
                    method, f"{server.url}{path}", headers=headers, json={}, timeout=10
                )
                if path in ("/health", "/ping"):
                    assert response.status_code == 200
                elif path.startswith(ADMIN_PREFIX):  # the cluster's admin token, not the key
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["error"]["code"] == "invalid_admin_token"
                else:
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["error"]["code"] == "invalid_api_key"
    authorized = {"authorization": f"Bearer {KEY}"}
    admin = [(path, methods) for path, methods in routes if path.startswith(ADMIN_PREFIX)]
    assert admin
    for path, methods in admin:  # the API key does not open the admin routes either
        for method in methods:
            response = httpx.request(method, f"{server.url}{path}", headers=authorized, json={})
            assert response.status_code == 401, (method, path)
    assert httpx.get(f"{server.url}/v1/models", headers=authorized).status_code == 200
    assert httpx.get(f"{server.url}/metrics", headers=authorized).status_code == 200
    assert generate(server).status_code == 200
