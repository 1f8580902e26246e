"""`pdserve serve` starts router + node, and SIGTERM or SIGINT stops all of them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.wire.free_ports import free_port
from tests.fault_checks import alive, children_of, live_nodes, wait_until


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_stops_every_process_the_launcher_started(tiny_llama_dir, signum, tmp_path):
    port = free_port()
    stderr = open(tmp_path / "stderr.txt", "w+")  # noqa: SIM115 (closed below)
    # MODEL positional; once, a second served name (the first stays the one listed).
    aliases = ["--served-model-name", tiny_llama_dir.name, "alias"] if signum == signal.SIGINT else []
    # A non-default engine option, handed to the nodes as data, comes back in their NodeStats.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pdserve.commands.cli", "serve", str(tiny_llama_dir),
         "--port", str(port),
         "--max-model-len", "96", *aliases],
        stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
    )
    children: list[int] = []
    try:
        ready_line = ""
        while not ready_line.startswith("pdserve is serving"):
            ready_line = launcher.stdout.readline()
            assert ready_line, "the launcher exited before it was ready"
        assert f"http://127.0.0.1:{port}/v1" in ready_line
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        # Ready means one node can serve (a decode node computes prompts itself meanwhile);
        # the prefill node may still be loading, and this test stops both once they serve.
        wait_until(lambda: len(live_nodes(f"http://127.0.0.1:{port}")) == 2, 120, "2 live nodes")
        # MODEL as a path is served by its folder's name (as the README's request names it).
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]
        assert [card["id"] for card in models] == [tiny_llama_dir.name]
        assert models[0]["max_model_len"] == 96
        for name in [tiny_llama_dir.name, *aliases[2:]]:
            body = {"model": name, "prompt": "hi", "max_tokens": 1}
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        children = children_of(launcher.pid)
        assert len(children) == 3  # a prefill node, a decode node, the router
        if signum == signal.SIGINT:  # as a terminal's Ctrl-C: to the launcher's process group
            os.killpg(launcher.pid, signum)
        else:
            launcher.send_signal(signum)
        assert launcher.wait(30) == (-signal.SIGKILL if signum == signal.SIGKILL else 0)
        deadline = time.monotonic() + 30  # SIGTERM from the kernel; a busy host is slow
        while any(alive(pid) for pid in children):
            assert time.monotonic() < deadline, "a child outlived the launcher"
            time.sleep(0.1)
        if signum != signal.SIGKILL:  # a quiet stop: one line per process, no traceback
            stderr.seek(0)
            said = stderr.read()
            assert "Traceback" not in said, said
            for line in (f"node prefill-0.{port} stopped", f"node decode-0.{port} stopped",
                         "router stopped"):
                assert said.count(line) == 1, (line, said)
    finally:
        stderr.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_folder_that_is_no_model_is_refused_before_any_process_starts(tmp_path):
    launcher = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "serve", "--model", str(tmp_path),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert launcher.returncode == 2
    assert launcher.stderr.strip() == f"pdserve: {tmp_path} is not a model folder: it has no config.json"


def test_a_node_setting_out_of_range_is_refused_before_any_process_starts(tiny_llama_dir):
    """The launcher builds each node's EngineConfig once before starting it: the dataclass's
    own check, in the flag's terms, with `pdserve serve`'s usage."""
    launcher = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "serve", str(tiny_llama_dir), "--port",
         str(free_port()), "--colocated", "--max-num-seqs", "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert launcher.returncode == 2
    assert "Traceback" not in launcher.stderr
    assert "pdserve serve: error: --max-num-seqs must be >= 1, got 0" in launcher.stderr


def test_a_child_that_fails_to_start_is_one_line_naming_it_and_its_log(tiny_llama_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")  # only loading finds it
    port = free_port()
    launcher = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "serve", str(folder), "--port", str(port),
         "--colocated"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert launcher.returncode == 1
    assert "Traceback" not in launcher.stderr
    lines = launcher.stderr.strip().splitlines()
    assert len(lines) == 1, launcher.stderr
    match = re.fullmatch(
        rf"pdserve: (colocated-0\.{port}) exited with status (\d+) during start-up: (.*) "
        r"\(full log: (.*)\)",
        lines[0],
    )
    assert match is not None, lines[0]
    assert match[2] != "0" and match[3].strip()
    log = Path(match[4]).read_text()
    assert match[3] in log and "Traceback" in log


def test_a_port_another_program_holds_is_one_line_naming_the_address(tiny_llama_dir):
    with socket.create_server(("127.0.0.1", free_port())) as holder:
        port = holder.getsockname()[1]
        launcher = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "serve", str(tiny_llama_dir),
             "--port", str(port), "--colocated"],
            capture_output=True, text=True, timeout=120, check=False,
        )
    assert launcher.returncode == 1
    assert "Traceback" not in launcher.stderr
    assert (
        f"pdserve: router exited with status 1 during start-up: cannot listen on "
        f"127.0.0.1:{port}: Address already in use"
    ) in launcher.stderr


def test_a_router_stopped_by_two_quick_sigints_exits_quietly(tiny_llama_dir, tmp_path):
    """Two Ctrl-Cs in a row (the second forces uvicorn's exit): one line, no traceback."""
    output_path = tmp_path / "router.txt"
    with open(output_path, "w") as output:
        router = subprocess.Popen(
            [sys.executable, "-m", "pdserve.router", "--model", str(tiny_llama_dir),
             "--port", str(free_port()), "--node", f"tcp://127.0.0.1:{free_port()}",
             "--listen", f"tcp://127.0.0.1:{free_port()}", "--uvicorn-log-level", "info"],
            stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        wait_for_line(output_path, "pdserve router listening", router)
        router.send_signal(signal.SIGINT)
        wait_for_line(output_path, "Shutting down", router)  # uvicorn's, at INFO
        router.send_signal(signal.SIGINT)
        assert router.wait(60) in (0, -signal.SIGINT)
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()
    said = output_path.read_text()
    assert "Traceback" not in said, said
    assert said.count("router stopped") == 1, said


def wait_for_line(path: Path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while text not in path.read_text():
        assert process.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"the process never said {text!r}"
        time.sleep(0.05)
