"""The colocated node as a real process on real sockets: `python -m pdserve.node colocated`.

The test side plays the router: it binds a PULL at the router address and connects a PUSH to
the node's listen address. One node serves the whole module; its finalizer sends SIGTERM and
expects a clean exit 0 (killing it if it does not stop in time).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from pdserve.engine import LLM, SamplingParams
from pdserve.wire.free_ports import free_port
from pdserve.wire.messages import (
    Abort,
    Generate,
    NodeStats,
    RequestFailed,
    TokenBatch,
    decode,
    encode,
)
from tests.fault_checks import stop_process
from tests.node_stats import node_stats

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0
REPLY_TIMEOUT = 30.0
PROMPTS = [[5, 17, 99, 300], [42] * 9, list(range(100, 131))]


class Router:
    """The router's side of the wire, with bounded waits."""

    def __init__(self, context: zmq.Context, listen: str, router: str) -> None:
        self.pull = context.socket(zmq.PULL)
        self.pull.bind(router)
        self.push = context.socket(zmq.PUSH)
        self.push.connect(listen)

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.pull.context.term()

    def send(self, message) -> None:
        self.push.send(encode(message))

    def recv(self, deadline: float):
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not self.pull.poll(remaining_ms):
            raise TimeoutError("no message from the node in time")
        return decode(self.pull.recv())

    def wait(self, kind=NodeStats, predicate=lambda m: True, timeout: float = REPLY_TIMEOUT):
        """The next message of a kind that satisfies `predicate`, skipping the others."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.recv(deadline)
            if isinstance(message, kind) and predicate(message):
                return message

    def collect(self, request_ids, timeout: float = REPLY_TIMEOUT) -> dict:
        """Gathers each request's updates until it finishes or fails."""
        results = {r: {"tokens": [], "logprobs": [], "failed": None} for r in request_ids}
        pending = set(results)
        deadline = time.monotonic() + timeout
        while pending:
            message = self.recv(deadline)
            if isinstance(message, TokenBatch):
                for update in message.updates:
                    result = results.get(update.request_id)
                    assert result is not None, f"update for unexpected {update.request_id}"
                    result["tokens"] += update.token_ids
                    result["logprobs"] += update.logprobs or []
                    result["num_prompt_tokens"] = update.num_prompt_tokens
                    if update.finish_reason is not None:
                        result["finish"] = update.finish_reason
                        pending.discard(update.request_id)
            elif isinstance(message, RequestFailed) and message.request_id in pending:
                results[message.request_id]["failed"] = message
                pending.discard(message.request_id)
        return results


@pytest.fixture(scope="module")
def node(tiny_llama_dir, tmp_path_factory):
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    router = Router(zmq.Context(), listen, router_address)
    log_path = tmp_path_factory.mktemp("node") / "stderr.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.node", "colocated", "--model", str(tiny_llama_dir),
         "--listen", listen]
        + f"--router {router_address} --node-id node-0 --num-kv-blocks 128 --dtype float32".split()
        + ["--heartbeat-interval", "0.2"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        stats = router.wait(timeout=READY_TIMEOUT)
        assert stats.identity.role == "colocated" and stats.identity.node_id == "node-0"
        assert stats.kv.num_free_blocks == stats.kv.num_total_blocks == 128
        yield router
    finally:
        stop_process(process, timeout_s=15)
        log.close()
        router.close()
    stderr = log_path.read_text()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]


def test_greedy_tokens_equal_offline_llm(node, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=16)
    for i, prompt in enumerate(PROMPTS):
        node.send(Generate(f"greedy-{i}", prompt, params))
    results = node.collect([f"greedy-{i}" for i in range(len(PROMPTS))])
    expected = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128).generate(
        PROMPTS, params
    )
    for i, (prompt, reference) in enumerate(zip(PROMPTS, expected)):
        result = results[f"greedy-{i}"]
        assert result["failed"] is None
        assert result["tokens"] == reference.token_ids
        assert result["finish"] == reference.finish_reason == "length"
        assert result["num_prompt_tokens"] == len(prompt)
        assert result["logprobs"] == []


def test_abort_stops_updates_and_frees_blocks(node):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    node.send(Generate("long", [7, 8, 9], params))
    received, deadline = 0, time.monotonic() + REPLY_TIMEOUT
    while received < 5:
        message = node.recv(deadline)
        if isinstance(message, TokenBatch):
            received += sum(len(u.token_ids) for u in message.updates)
    node.send(Abort("long"))
    node.send(Abort("never-existed"))
    late_tokens = 0
    deadline = time.monotonic() + REPLY_TIMEOUT
    while True:  # tokens already in flight may still arrive, until the abort is processed
        message = node.recv(deadline)
        if isinstance(message, TokenBatch):
            assert all(u.finish_reason is None for u in message.updates)
            late_tokens += sum(len(u.token_ids) for u in message.updates)
        elif isinstance(message, NodeStats) and message.scheduling.num_running == 0:
            break
    assert received + late_tokens < 500
    assert message.kv.num_free_blocks == message.kv.num_total_blocks
    assert message.scheduling.num_waiting == 0
    assert message.tokens.prompt_total >= sum(len(p) for p in PROMPTS) + 3
    assert message.tokens.generation_total >= 16 * len(PROMPTS) + received + late_tokens
    assert message.identity.max_model_len == 1024 and message.identity.vocab_size == 512
    with pytest.raises(TimeoutError):  # three more heartbeats, and no more tokens
        node.wait(TokenBatch, timeout=0.6)


def raw_generate(request_id: str, prompt: list[int], sampling: dict) -> bytes:
    """A Generate as any peer could write it, its sampling settings unchecked."""
    fields = {"request_id": request_id, "prompt_token_ids": prompt, "sampling": sampling}
    return msgpack.packb({"type": "generate", **fields})


def test_bad_requests_fail_and_garbage_is_dropped(node):
    node.send(Generate("bad-token", [5, 512, 6], SamplingParams(temperature=0)))
    node.push.send(raw_generate("bad-max", [5, 6], {"max_tokens": 0}))  # not the router's
    node.push.send(raw_generate("bad-key", [5, 6], {"no_such_option": 1}))
    node.push.send(b"\xc1 definitely not msgpack")
    node.push.send(msgpack.packb({"type": "launch_missiles", "request_id": "x"}))
    node.push.send(encode(node_stats(node_id="x", role="router")))
    node.send(Generate("after-garbage", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3)))
    results = node.collect(["bad-token", "bad-max", "bad-key", "after-garbage"])
    failed = {r: results[r]["failed"] for r in ("bad-token", "bad-max", "bad-key")}
    assert all(f is not None and f.status == 400 for f in failed.values()), failed
    assert "token id 512" in failed["bad-token"].message and "vocab" in failed["bad-token"].message
    assert "max_tokens" in failed["bad-max"].message
    assert "no_such_option" in failed["bad-key"].message
    after = results["after-garbage"]
    assert after["failed"] is None and after["finish"] == "length" and len(after["tokens"]) == 3


def test_duplicate_request_id_fails_without_disturbing_the_first(node):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    node.send(Generate("dup", [11, 12], params))
    node.send(Generate("dup", [13, 14], params))
    failed, tokens, finished = None, [], False
    deadline = time.monotonic() + REPLY_TIMEOUT
    while not finished:
        message = node.recv(deadline)
        if isinstance(message, RequestFailed):
            failed = message
        elif isinstance(message, TokenBatch):
            tokens += [t for u in message.updates for t in u.token_ids]
            finished = any(u.finish_reason for u in message.updates)
    assert failed is not None and failed.status == 400 and "already in use" in failed.message
    assert len(tokens) == 40


def test_logprobs_have_top_alternatives(node):
    node.send(Generate("lp", [20, 21, 22], SamplingParams(temperature=0, max_tokens=4, logprobs=2)))
    result = node.collect(["lp"])["lp"]
    assert result["failed"] is None and len(result["tokens"]) == len(result["logprobs"]) == 4
    for (token_id, logprob, top), sampled in zip(result["logprobs"], result["tokens"]):
        assert token_id == sampled and logprob <= 0.0
        assert len(top) == 2 and all(len(pair) == 2 for pair in top)
        assert top[0][0] == sampled  # greedy: the sampled token is the most likely one
        assert top[0][1] >= top[1][1]


def test_engine_error_fails_in_flight_requests_and_node_survives(tiny_llama_dir):
    from pdserve.engine.config import EngineConfig
    from pdserve.node.colocated import ColocatedNode
    from pdserve.node.config import NodeConfig

    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    node = ColocatedNode(
        engine_config=EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64),
        config=NodeConfig(
            node_id="node-x",
            listen_address=listen,
            router_address=router_address,
            heartbeat_interval=0.1,
        ),
    )
    real_step, calls = node.engine.step, []

    def flaky_step():
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("simulated device failure")
        return real_step()

    node.engine.step = flaky_step
    router = Router(zmq.Context(), listen, router_address)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        router.wait()
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        router.send(Generate("doomed", [5, 6], params))
        failed = router.collect(["doomed"])["doomed"]["failed"]
        assert failed is not None and failed.status == 500
        router.send(Generate("survivor", [5, 6], params))
        assert len(router.collect(["survivor"])["survivor"]["tokens"]) == 8
        stats = router.wait(NodeStats, lambda s: s.scheduling.num_running == 0)
        assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert not thread.is_alive()
