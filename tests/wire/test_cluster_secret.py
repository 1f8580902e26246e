"""The cluster secret (wire/cluster_auth.py): `pdserve serve` secures its own processes with a
secret it makes, handed over in their environment and never on a command line; a node with the
right secret joins the router from outside, one with a wrong secret never registers (and logs
why) while the deployment keeps serving; the KV channel works with the secret over shm and zmq and is out of
reach without it; a node or router asked for a non-loopback address without a secret refuses
to start (exit status 2, naming --cluster-secret)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import zmq

from pdserve.commands.serve_process import ServeProcess
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer import (
    ChannelReceiver,
    ChannelSender,
    ReceiverConfig,
    SenderConfig,
    TransferKind,
)
from pdserve.wire.cluster_auth import SECRET_ENV, ClusterAuth, is_loopback
from pdserve.wire.free_ports import free_port
from tests.fault_checks import HEARTBEAT_S, children_of, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
CPU = torch.device("cpu")
WRONG_SECRET = "not-the-secret-of-this-cluster"


def environment_without_secret() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


def test_keys_come_from_the_secret_alone_and_short_secrets_are_refused():
    first, again = ClusterAuth.from_secret("a" * 32), ClusterAuth.from_secret("a" * 32)
    other = ClusterAuth.from_secret("b" * 32)
    assert first == again and first.enabled
    assert first.server_public_key != other.server_public_key
    assert "aaaa" not in repr(first) and first.server_secret_key.decode() not in repr(first)
    assert not ClusterAuth.from_secret(None).enabled
    with pytest.raises(ValueError, match="has 5 characters; expected at least 16"):
        ClusterAuth.from_secret("short")
    context = zmq.Context()
    try:
        plain = ClusterAuth.none().secure_server(context.socket(zmq.PULL))
        server = first.secure_server(context.socket(zmq.PULL))
        client = first.secure_client(context.socket(zmq.PUSH))
        assert plain.getsockopt(zmq.MECHANISM) == zmq.NULL
        assert server.getsockopt(zmq.MECHANISM) == zmq.CURVE and server.getsockopt(
            zmq.CURVE_SERVER
        )
        assert client.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert not client.getsockopt(zmq.CURVE_SERVER)
        for sock in (plain, server, client):
            sock.close(0)
    finally:
        context.term()


def test_only_loopback_addresses_are_allowed_without_a_secret():
    for address in ("tcp://127.0.0.1:5", "tcp://127.9.0.1:5", "tcp://[::1]:5",
                    "tcp://localhost:5", "ipc:///tmp/x", "inproc://x"):
        assert is_loopback(address), address
    for address in ("tcp://0.0.0.0:5", "tcp://*:5", "tcp://10.1.2.3:5", "tcp://eth0:5",
                    "tcp://node7.example:5", "tcp://127.0.0.1:0;10.1.2.3:5", "udp://127.0.0.1:5"):
        assert not is_loopback(address), address
    ClusterAuth.none().check_addresses([("--listen", "tcp://127.0.0.1:5"), ("--advertise", None)])
    with pytest.raises(ValueError, match="--advertise tcp://10.1.2.3:5 .*--cluster-secret"):
        ClusterAuth.none().check_addresses(
            [("--listen", "tcp://127.0.0.1:5"), ("--advertise", "tcp://10.1.2.3:5")]
        )
    ClusterAuth.from_secret("c" * 16).check_addresses([("--listen", "tcp://0.0.0.0:5")])


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_kv_channel_with_the_secret_transfers_and_without_it_never_gets_a_grant(
    transport, node_id
):
    auth = ClusterAuth.from_secret("kv-channel-secret-1234")
    receiver = ChannelReceiver(transport, ReceiverConfig(node_id, cluster_auth=auth))
    cache = receiver.allocate_kv_cache(SPEC, 16, CPU)
    descriptor = receiver.register(cache, "fp")
    local = KVCache(SPEC, 16, CPU)
    local.buffer.copy_(torch.randn(local.buffer.shape))
    senders = {
        name: ChannelSender(
            transport, SenderConfig(grant_timeout_s=0.5, step_bytes=1 << 16, cluster_auth=key)
        )
        for name, key in (
            ("right", auth),
            ("wrong", ClusterAuth.from_secret(WRONG_SECRET)),
            ("none", ClusterAuth.none()),
        )
    }
    try:
        for sender in senders.values():
            sender.connect(descriptor, local, "fp")
        for index, name in enumerate(("wrong", "none")):
            receiver.expect(name, [index], time.monotonic() + 5)
            senders[name].write(name, [index], [index])
        for name in ("wrong", "none"):
            event = senders[name].wait(name, 5)
            # Without a handshake the channel has no peer: the first send is refused at once,
            # or (once the socket queues it) no grant ever comes.
            assert event.kind is TransferKind.FAILED, event
            assert "no grant" in event.error or "not accepting messages" in event.error, event
        assert not torch.equal(cache.buffer[:, :, :2], local.buffer[:, :, :2])
        for name in ("wrong", "none"):
            receiver.abort(name)
        receiver.expect("right", [5, 6, 7], time.monotonic() + 5)
        senders["right"].write("right", [0, 1, 2], [5, 6, 7])
        assert senders["right"].wait("right", 5).kind is TransferKind.COMPLETE
        assert receiver.wait("right", 5).kind is TransferKind.COMPLETE
        assert torch.equal(cache.buffer[:, :, 5:8], local.buffer[:, :, 0:3])
    finally:
        for sender in senders.values():
            sender.close()
        receiver.close()


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "pdserve.node", "prefill", "--node-id", "p", "--listen", "tcp://0.0.0.0:{port}",
         "--router", "tcp://127.0.0.1:{port}"],
        ["-m", "pdserve.node", "decode", "--node-id", "d", "--listen",
         "tcp://127.0.0.1:{port}", "--router", "tcp://127.0.0.1:{port}",
         "--kv-listen", "tcp://0.0.0.0:0"],
        ["-m", "pdserve.node", "prefill", "--node-id", "p", "--listen", "tcp://127.0.0.1:{port}",
         "--router", "tcp://10.1.2.3:{port}"],
        ["-m", "pdserve.router", "--model", "m", "--node", "tcp://127.0.0.1:{port}",
         "--listen", "tcp://0.0.0.0:{port}"],
        ["-m", "pdserve.commands.cli", "serve", "--router-listen", "tcp://0.0.0.0:{port}"],
        ["-m", "pdserve.commands.cli", "serve", "--cluster-secret", "short"],
    ],
    ids=["node-listen", "kv-listen", "remote-router", "router-listen", "serve", "short-secret"],
)
def test_non_loopback_addresses_without_a_secret_are_refused_at_start(argv, tmp_path):
    port = free_port()
    result = subprocess.run(
        [sys.executable, *(part.format(port=port) for part in argv)],
        cwd=ROOT, env=environment_without_secret(), capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("--cluster-secret" in result.stderr or "at least 16" in result.stderr), result.stderr


def node_up(server: ServeProcess) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {
        sample.labels["node"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pdserve_node_up"
    }


def start_joiner(tiny_llama_dir, node_id: str, router: str, log: Path, secret_flag: list[str],
                 env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.commands.cli", "prefill",
             "--model", str(tiny_llama_dir),
             "--node-id", node_id, "--listen", "tcp://127.0.0.1:0",
             "--router", router, "--kv-cache-memory", str(16 << 20), *secret_flag],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
        )


def test_generated_secret_stays_off_command_lines_and_only_its_holders_join(
    tiny_llama_dir, tmp_path
):
    router = f"tcp://127.0.0.1:{free_port()}"
    server = ServeProcess(
        ["--model", str(tiny_llama_dir), "--kv-cache-memory", str(32 << 20),
         "--router-listen", router, "--disagg-policy", "always"],
        ready_timeout_s=120,
    )
    joiners: list[subprocess.Popen] = []
    try:
        children = children_of(server.process.pid)
        assert len(children) == 3, children  # the router, a prefill node, a decode node
        prefix = f"{SECRET_ENV}=".encode()
        given = {
            entry.removeprefix(prefix).decode()
            for pid in children
            for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if entry.startswith(prefix)
        }
        (secret,) = given  # one secret, in every child's environment
        assert all(prefix in Path(f"/proc/{pid}/environ").read_bytes() for pid in children)
        assert len(secret) >= 32
        for pid in [server.process.pid, *children]:
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()

        body = {"model": tiny_llama_dir.name, "prompt": "hello", "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200

        logs = {name: tmp_path / f"{name}.log" for name in ("wrong", "right")}
        joiners = [
            start_joiner(tiny_llama_dir, "wrong", router, logs["wrong"], [],
                         {**environment_without_secret(), SECRET_ENV: WRONG_SECRET}),
            start_joiner(tiny_llama_dir, "right", router, logs["right"],
                         ["--cluster-secret", secret], environment_without_secret()),
        ]
        refused = "refuses the connection handshake"

        def right_joined_and_wrong_refused() -> bool:
            for name, joiner in zip(("wrong", "right"), joiners):
                assert joiner.poll() is None, f"{name} exited: {logs[name].read_text()[-2000:]}"
            return node_up(server).get("right") == 1 and refused in logs["wrong"].read_text()

        wait_until(right_joined_and_wrong_refused, 120, "the right node joining, the wrong refused")
        # Not an ordering wait: the wrong node must stay unheard through four more heartbeats.
        unheard_until = time.monotonic() + 4 * HEARTBEAT_S
        while time.monotonic() < unheard_until:
            assert "wrong" not in node_up(server), node_up(server)
            time.sleep(0.1)
        assert refused not in logs["right"].read_text()
        assert joiners[0].poll() is None  # it runs, unheard
        for _ in range(3):
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"]
        assert "wrong" not in node_up(server)
    finally:
        for joiner in joiners:
            stop_process(joiner)
        server.close()
