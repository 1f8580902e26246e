"""`--kv-transport`: the launcher offers `auto` and every serving transport the registry has, and
`auto` picks one: shm or cuda_ipc on one host, mooncake (else zmq) for a deployment other hosts
join; asking for mooncake where it cannot run fails at start, naming what to install."""

from __future__ import annotations

import pytest
import torch

from pdserve.commands import launcher
from pdserve.commands.cli import build_parser
from pdserve.commands.launcher_settings import KV_TRANSPORTS
from pdserve.kvtransfer import TRANSPORT_NAMES
from pdserve.kvtransfer.transports import mooncake_engine

MISSING = "the mooncake KV transport needs the Python package mooncake-transfer-engine-non-cuda"


@pytest.fixture
def cpu_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_flag_offers_auto_and_every_serving_transport():
    assert KV_TRANSPORTS == ("auto", *TRANSPORT_NAMES)


def test_auto_keeps_one_host_deployments_on_shared_memory(cpu_host):
    assert launcher.choose_kv_transport("auto") == "shm"
    assert launcher.choose_kv_transport("zmq", across_hosts=True) == "zmq"


def test_auto_across_hosts_picks_mooncake_where_installed_else_zmq(cpu_host, monkeypatch):
    monkeypatch.setattr(mooncake_engine, "mooncake_missing", lambda: None)
    assert launcher.choose_kv_transport("auto", across_hosts=True) == "mooncake"
    monkeypatch.setattr(mooncake_engine, "mooncake_missing", lambda: MISSING)
    assert launcher.choose_kv_transport("auto", across_hosts=True) == "zmq"


def test_auto_across_hosts_on_gpus_picks_zmq(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mooncake_engine, "mooncake_missing", lambda: None)
    assert launcher.choose_kv_transport("auto", across_hosts=True) == "zmq"


def test_mooncake_asked_for_but_missing_fails_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(mooncake_engine, "mooncake_missing", lambda: MISSING)
    with pytest.raises(ValueError, match="--kv-transport mooncake: .*non-cuda"):
        launcher.choose_kv_transport("mooncake")


def test_a_router_other_hosts_reach_makes_the_deployment_cross_host(cpu_host, monkeypatch):
    monkeypatch.setattr(mooncake_engine, "mooncake_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    def planned_transport(router_listen: str) -> str:
        args = build_parser().parse_args(
            ["serve", "--model", "m", "--router-listen", router_listen]
        )
        nodes = launcher.plan_nodes(args, "m", router_listen)
        (transport,) = {node.config["node"]["kv_transport"] for node in nodes}
        return transport

    assert planned_transport("tcp://127.0.0.1:29871") == "shm"
    assert planned_transport("tcp://0.0.0.0:29871") == "mooncake"
