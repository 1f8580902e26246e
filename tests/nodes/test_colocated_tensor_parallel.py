"""A colocated node with `--tensor-parallel-size 2` as a real process: one node is two rank
processes (the node, rank 0, and its one worker), its greedy tokens equal the one-rank
offline engine's, and SIGTERM stops both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zmq

from pdserve.engine import LLM, SamplingParams
from pdserve.wire.messages import Generate
from tests.fault_checks import stop_process, wait_until
from tests.nodes.test_colocated_node import PROMPTS, READY_TIMEOUT, Router, free_port

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_two_rank_colocated_node_serves_the_one_rank_tokens_and_stops_its_worker(
    tiny_llama_dir, tmp_path
):
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    router = Router(zmq.Context(), listen, router_address)
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.node", "colocated", "--model", str(tiny_llama_dir),
             "--listen", listen, "--router", router_address, "--node-id", "tp-node",
             "--num-kv-blocks", "64", "--dtype", "float32", "--tensor-parallel-size", "2",
             "--num-threads", "2", "--heartbeat-interval", "0.2"],
            cwd=ROOT,
            env=os.environ,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        workers = []
        try:
            stats = router.wait(timeout=READY_TIMEOUT)
            assert stats.kv.num_total_blocks == 64
            workers = children(process.pid)
            assert len(workers) == 1  # rank 1; rank 0 is the node itself
            params = SamplingParams(temperature=0, max_tokens=12)
            for i, prompt in enumerate(PROMPTS):
                router.send(Generate(f"tp-{i}", prompt, params))
            results = router.collect([f"tp-{i}" for i in range(len(PROMPTS))])
            expected = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64).generate(
                PROMPTS, params
            )
            for i, reference in enumerate(expected):
                assert results[f"tp-{i}"]["failed"] is None
                assert results[f"tp-{i}"]["tokens"] == reference.token_ids
        finally:
            stop_process(process)
            router.close()
    stderr = log_path.read_text()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    wait_until(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers),
        10,
        "the rank-1 worker exiting with its node",
    )
