"""Mooncake in tests: a test that needs it fails (it does not skip) where Mooncake ships a wheel
but it is not installed, so CI cannot pass without running it (`make install` installs the
`mooncake` extra and libibverbs1); elsewhere (macOS, Python 3.14+) it skips.

Mooncake's engines pick their ports at random in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, read once
per process when its library loads. Importing this module sets that range (unless already set)
for the test process and every process it starts afterwards (peers, servers, nodes): test
modules import it at collection, before any test runs."""

from __future__ import annotations

import os
import sys

import pytest

from pdserve.kvtransfer.transports.mooncake_engine import mooncake_missing

MOONCAKE_PORT_RANGE = {"MC_MIN_RPC_PORT": "29800", "MC_MAX_RPC_PORT": "29999"}
for _name, _value in MOONCAKE_PORT_RANGE.items():
    os.environ.setdefault(_name, _value)


def mooncake_has_a_wheel_here() -> bool:
    return sys.platform.startswith("linux") and (3, 10) <= sys.version_info[:2] <= (3, 13)


def require_mooncake() -> None:
    if not mooncake_has_a_wheel_here():
        pytest.skip("Mooncake ships wheels for Linux and CPython 3.10-3.13 only")
    missing = mooncake_missing()
    if missing is not None:
        pytest.fail(f"{missing} (`make install` installs both)")
