"""bench/vs_peers.py and its parts without pdserve or a peer serving a model: the CPU time of a
process tree, how each peer is started (and what is said when it is not), real child processes
standing in for a peer's HTTP port, and the table's ratios."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench import vs_peers
from pdserve.bench.peer_servers import (
    PeerLaunch,
    PeerMissing,
    PeerServer,
    llamacpp_launch,
    vllm_launch,
)
from pdserve.bench.serve_load import RequestTiming, summarize
from pdserve.bench.server_processes import cpu_seconds, process_tree, tree_cpu_seconds
from pdserve.bench.vs_peers import (
    parse_args,
    pdserve_allocator,
    pdserve_paths,
    run_peer,
    start_peer,
)
from pdserve.bench.vs_peers_report import LLAMACPP, VLLM, build_report, comparison_table
from pdserve.wire.free_ports import free_port

BURN = (
    "import signal, time\n"
    "start = time.process_time()\n"
    "while time.process_time() - start < 0.5:\n"
    "    pass\n"
    "print('burnt', flush=True)\n"
    "signal.pause()\n"
)


def test_the_cpu_time_of_a_tree_counts_its_grandchildren():
    # a shell whose child burns half a CPU-second: the shell itself uses almost none
    shell = subprocess.Popen(
        ["bash", "-c", f"{sys.executable} -c \"$BURN\" & wait"],
        env={"BURN": BURN, "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: the grandchild ends with it
    )
    try:
        assert shell.stdout.readline().strip() == "burnt"
        tree = process_tree(shell.pid)
        assert tree[0] == shell.pid and len(tree) == 2
        assert tree_cpu_seconds(shell.pid) >= 0.45
        assert cpu_seconds(shell.pid) < 0.45
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_vllm_is_started_as_its_cpu_docs_ask_with_the_preloads_that_exist(tmp_path):
    venv = tmp_path / "vllm-env"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    python = venv / "bin" / "python"
    launch = vllm_launch(python, tmp_path / "model", 8123, "float32", 64, 224)
    assert launch.command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(launch.command)
    for part in ("--host 127.0.0.1", "--port 8123", "--dtype float32", "--max-num-seqs 64",
                 "--max-model-len 224", f"--model {tmp_path / 'model'}"):
        assert part in joined
    assert launch.environment["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "libiomp5" not in launch.environment.get("LD_PRELOAD", "")
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    with_iomp = vllm_launch(python, tmp_path / "model", 8123, "float32", 64, 224)
    assert str(venv / "lib" / "libiomp5.so") in with_iomp.environment["LD_PRELOAD"].split(":")
    assert with_iomp.describe().startswith("VLLM_CPU_KVCACHE_SPACE=4 LD_PRELOAD=")


def test_llamacpp_gets_a_slot_per_stream_and_every_thread():
    launch = llamacpp_launch(Path("llama-server"), Path("m.gguf"), 8124, 64, 224, 2)
    assert " ".join(launch.command) == (
        "llama-server -m m.gguf --host 127.0.0.1 --port 8124 -np 64 -c 14336 -cb -t 2 -tb 2"
    )
    assert launch.environment == {}


def test_a_peer_not_given_is_not_measured_with_how_to_get_it(tmp_path):
    args = parse_args(["--servers", "vllm,llamacpp", "--quick"])
    with pytest.raises(PeerMissing, match="no --vllm-python given: install vLLM's CPU build"):
        start_peer("vllm", args, tmp_path, tmp_path)
    with pytest.raises(PeerMissing, match="no --llamacpp-server given: build llama.cpp's server"):
        start_peer("llamacpp", args, tmp_path, tmp_path)


def test_a_peer_that_exits_says_its_status_command_and_log(tmp_path):
    launch = PeerLaunch([sys.executable, "-c", "print('no such model'); raise SystemExit(3)"], {})
    with pytest.raises(PeerMissing) as missing:
        PeerServer("vLLM", launch, free_port(), tmp_path / "peer.log", ready_timeout_s=60)
    text = str(missing.value)
    assert "exited with status 3" in text and "no such model" in text and "SystemExit" in text


def file_server(folder: Path) -> tuple[list[str], int]:
    """Python's own file server, serving /health and /v1/models, to stand in for a peer's
    port: its command and port. It takes SIGINT as a peer does, even where the shell that
    started the tests ignores it (a background job's children inherit that), so `close` ends
    it at once rather than after its 30 s grace."""
    (folder / "site" / "v1").mkdir(parents=True)
    (folder / "site" / "health").write_text("ok")
    (folder / "site" / "v1" / "models").write_text('{"data": []}')
    port = free_port()
    serve = (
        "import runpy, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"sys.argv = ['http.server', '{port}', '--bind', '127.0.0.1', '--directory', sys.argv[1]]\n"
        "runpy.run_module('http.server', run_name='__main__')\n"
    )
    return [sys.executable, "-c", serve, str(folder / "site")], port


def test_a_peer_is_ready_when_health_and_models_answer_and_close_ends_its_group(tmp_path):
    command, port = file_server(tmp_path)
    peer = PeerServer("llama.cpp", PeerLaunch(command, {"EXTRA": "1"}), port, tmp_path / "p.log")
    try:
        assert peer.url == f"http://127.0.0.1:{port}" and peer.process.poll() is None
        assert process_tree(peer.pid) == [peer.pid]
    finally:
        peer.close()
    assert peer.process.poll() is not None
    assert "GET /health" in (tmp_path / "p.log").read_text()


def test_a_peers_time_from_launch_to_ready_is_in_the_setup(tmp_path, monkeypatch):
    command, port = file_server(tmp_path)  # stands in for vLLM's port; no wave is run
    monkeypatch.setattr(
        vs_peers, "start_peer",
        lambda *_: PeerServer("vLLM", PeerLaunch(command, {}), port, tmp_path / "p.log"),
    )
    monkeypatch.setattr(vs_peers, "measure", lambda *_: {1: {"done": 0}})
    setup: dict[str, str] = {}
    args = parse_args(["--servers", "vllm", "--quick"])

    assert run_peer("vllm", args, {}, [], tmp_path, tmp_path, setup) == {1: {"done": 0}}

    ready = setup["vLLM: ready after"]
    seconds = float(ready.split(" s from launch")[0])
    assert 0.0 < seconds < 120.0, ready


def test_the_paths_a_pdserve_server_chose_come_from_its_log(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text(
        "2026-12-05 16:24:10,653 INFO pdserve.engine.runner.model_runner: dtype float32: auto\n"
        "2026-12-05 16:24:11,083 INFO pdserve.engine.runner.model_runner: linear weights "
        "quantized to int8: 129.2 MiB a decode step reads\n"
        "2026-12-05 16:24:13,084 INFO pdserve.engine.runner.model_runner: compiled on the CPU: "
        "one-sequence decode steps\n"
        "2026-12-05 16:24:13,090 INFO pdserve.engine.runner.model_runner: compiled on the CPU: "
        "one-sequence decode steps\n"
        "2026-12-05 16:24:14,000 INFO pdserve.router: listening\n"
    )
    assert pdserve_paths(log) == (
        "compiled on the CPU: one-sequence decode steps; dtype float32: auto; "
        "linear weights quantized to int8: 129.2 MiB a decode step reads"
    )
    log.write_text("nothing of note\n")
    assert pdserve_paths(log) == "not logged"


def test_the_allocator_a_pdserve_server_ran_with_comes_from_its_launchers_line(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text(
        "pdserve: process logs in /somewhere (--verbose: here)\n"
        "pdserve: processes allocate with tcmalloc (/usr/lib/libtcmalloc_minimal.so.4)\n"
        "2026-12-05 16:24:14,000 INFO pdserve.router: listening\n"
    )
    assert pdserve_allocator(log) == "tcmalloc (/usr/lib/libtcmalloc_minimal.so.4)"
    log.write_text("nothing of note\n")
    assert pdserve_allocator(log) == "not logged"


def _summary(tokens: int, wall: float, cpu: float) -> dict:
    timings = [
        RequestTiming("random", ok=True, ttft=0.1, e2e=0.4, output_tokens=tokens, itls=[0.1] * 3)
        for _ in range(4)
    ]
    summary = summarize(timings, wall)
    summary["cpu_s"], summary["tok_per_cpu_s"] = cpu, 4 * tokens / cpu
    return summary


def test_each_pdserve_row_is_divided_by_each_peer_in_tok_s_and_tok_per_cpu_s():
    results = {
        "pdserve colocated": {1: _summary(10, 2.0, 2.0), 16: _summary(10, 1.0, 2.0)},
        VLLM: {1: _summary(10, 4.0, 0.8), 16: None},
        LLAMACPP: None,
    }
    table = comparison_table(results, [1, 16])
    # 40 tokens in 2 s with 2 CPU-s against 40 in 4 s with 0.8 CPU-s; no llama.cpp to divide by
    ours = "| 1 | pdserve colocated | 4/4 | 20.0 | 20.0 | 100 | 100 | 100 | 1.0 | 2.00x | 0.40x |"
    assert ours + "  |  |" in table
    theirs = f"| 1 | {VLLM} | 4/4 | 10.0 | 50.0 | 100 | 100 | 100 | 0.2 | baseline | baseline |"
    assert theirs + "  |  |" in table
    assert f"| 16 | {VLLM} | not measured |" in table and f"| 1 | {LLAMACPP} | not measured |" in (
        table
    )
    row_16 = next(line for line in table.splitlines() if line.startswith("| 16 | pdserve"))
    assert row_16.endswith("| 2.0 |  |  |  |  |")
    report = build_report("cmd", {"cpu": "x"}, {"vLLM": "not measured: why"}, results, [1], "0.1")
    assert report.startswith("# pdserve vs vLLM's CPU build and llama.cpp's server")
    assert "not measured: why" in report


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--servers", "tgi"], "--servers ['tgi']: choose from colocated"),
        (["--concurrency", "0"], "--concurrency is '0'"),
        (["--output-len", "0"], "--output-len is 0; expected at least 1"),
        (["--warmup", "-1"], "--warmup is -1"),
    ],
)
def test_bad_flags_name_the_value(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def test_a_preloaded_pdserve_server_is_a_row_of_its_own_named_by_its_libraries(tmp_path):
    from pdserve.bench.vs_peers import pdserve_row

    assert pdserve_row("colocated", None) == "pdserve colocated"
    preload = "/usr/lib/libtcmalloc_minimal.so.4:/env/lib/libiomp5.so"
    assert pdserve_row("1p1d", preload) == "pdserve 1P+1D + libtcmalloc_minimal, libiomp5"
    library = tmp_path / "liba.so"
    library.write_bytes(b"")
    assert parse_args(["--pdserve-preload", str(library)]).pdserve_preload == str(library)


def test_a_preload_that_does_not_exist_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--pdserve-preload", f"{tmp_path}/libnone.so"])
    assert "--pdserve-preload names" in capsys.readouterr().err
