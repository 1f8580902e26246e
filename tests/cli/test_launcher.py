"""`pdserve serve` starts router + node, and SIGTERM or SIGINT stops all of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.launcher import free_port
from tests.fault_checks import alive, children_of


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_stops_every_process_the_launcher_started(tiny_llama_dir, signum):
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama_dir),
         "--port", str(port)],
        stdout=subprocess.PIPE, text=True,
    )
    children: list[int] = []
    try:
        ready_line = ""
        while not ready_line.startswith("pdserve is serving"):
            ready_line = launcher.stdout.readline()
            assert ready_line, "the launcher exited before it was ready"
        assert f"http://127.0.0.1:{port}/v1" in ready_line
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        children = children_of(launcher.pid)
        assert len(children) == 3  # a prefill node, a decode node, the router
        launcher.send_signal(signum)
        assert launcher.wait(30) == (-signal.SIGKILL if signum == signal.SIGKILL else 0)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in children):
            assert time.monotonic() < deadline, "a child outlived the launcher"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_launcher_fails_when_a_process_cannot_start(tmp_path):
    launcher = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tmp_path),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert launcher.returncode != 0
