"""End to end through the router, real processes: disaggregated serving (prefill nodes and
decode nodes, KV over shared memory) gives the same greedy text as colocated serving, for 32
concurrent requests with shared prefixes and different lengths under chunked prefill, with
1P1D and 2P2D (KV over shm; 1P1D also over zmq and mooncake, with two tensor-parallel ranks on
each node, and with `--disagg-policy auto`, which computes the shorter prompts on the decode
node); every node's KV blocks are all free afterwards. Each deployment runs with the
cluster secret `pdserve serve` makes for its processes (CURVE on every ZeroMQ link, the KV
channel included); a node joining from outside is given the secret."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.commands.serve_process import ServeProcess
from pdserve.wire.free_ports import free_port
from tests.fault_checks import assert_no_leaked_blocks, live_nodes, wait_until
from tests.mooncake_env import require_mooncake

# How many times each deployment answers the 32 requests and must match colocated: `make
# test-stress` asks for several rounds with every core busy (a transfer that committed before
# every byte landed would show as a rare divergence, not a steady one).
ROUNDS = int(os.environ.get("PDSERVE_TEST_ROUNDS", "1"))
# fp32: the greedy texts compared across deployments must not hinge on bf16 near-ties.
SERVE_FLAGS = [
    "--max-num-batched-tokens", "32", "--kv-cache-memory", str(32 << 20), "--dtype", "float32"
]


class Server(ServeProcess):
    """`pdserve serve` with `layout`; a disaggregated one computes every prompt on its prefill
    nodes (`--disagg-policy always`) unless `layout` names a policy."""

    def __init__(self, model_dir, *layout: str) -> None:
        policy = [] if "--disagg-policy" in layout else ["--disagg-policy", "always"]
        super().__init__(
            ["--model", str(model_dir), *SERVE_FLAGS, *policy, *layout], ready_timeout_s=120
        )

    def metric_by_node(self, name: str) -> dict[str, float]:
        return self.metric_by_label(name, "node")

    def metric_by_label(self, name: str, label: str) -> dict[str, float]:
        """`label`'s value -> the sum of the samples of `name` with it."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    key = sample.labels.get(label, "")
                    totals[key] = totals.get(key, 0.0) + sample.value
        return totals

    def wait_all_blocks_free(self) -> None:
        assert_no_leaked_blocks(self.url)


def requests_with_shared_prefixes(count: int = 32) -> list[dict]:
    rng = random.Random(11)
    systems = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 70, 17)]
    bodies = []
    for i in range(count):
        prompt = rng.choice(systems) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))]
        bodies.append(
            {
                "model": "m",
                "prompt": prompt,
                "max_tokens": rng.randrange(1, 24),
                "temperature": 0,
                "ignore_eos": True,
            }
        )
    return bodies


def run_concurrently(url: str, bodies: list[dict]) -> list[tuple[str, int]]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            models = (await http.get("/v1/models")).json()["data"]

            async def one(body):
                response = await http.post(
                    "/v1/completions", json={**body, "model": models[0]["id"]}
                )
                assert response.status_code == 200, response.text
                data = response.json()
                return data["choices"][0]["text"], data["usage"]["completion_tokens"]

            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def colocated_answers(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--colocated")
    try:
        answers = run_concurrently(server.url, requests_with_shared_prefixes())
        server.wait_all_blocks_free()
        return answers
    finally:
        server.close()


@pytest.mark.parametrize(
    "layout",
    [
        ("1", "1", "shm"),
        ("2", "2", "shm"),
        ("1", "1", "zmq"),
        ("1", "1", "mooncake"),
        ("1", "1", "shm", "--tensor-parallel-size", "2"),
        ("1", "1", "shm", "--disagg-policy", "auto", "--local-prefill-tokens", "64"),
    ],
    ids=["1P1D", "2P2D", "zmq", "mooncake", "1P1D-tp2", "1P1D-auto"],
)
def test_disaggregated_text_equals_colocated_text(tiny_llama_dir, colocated_answers, layout):
    if layout[2] == "mooncake":
        require_mooncake()
    server = Server(
        tiny_llama_dir, "--prefill", layout[0], "--decode", layout[1], "--kv-transport", layout[2],
        *layout[3:],
    )
    try:
        expected_nodes = sorted(
            [f"prefill-{i}.{server.port}" for i in range(int(layout[0]))]
            + [f"decode-{i}.{server.port}" for i in range(int(layout[1]))]
        )
        wait_until(  # /health needs one live pair; the rest may lag
            lambda: live_nodes(server.url) >= set(expected_nodes), 90, "every node up"
        )
        assert sorted(server.metric_by_node("pdserve_kv_cache_usage_ratio")) == expected_nodes
        for round_index in range(ROUNDS):
            answers = run_concurrently(server.url, requests_with_shared_prefixes())
            assert answers == colocated_answers, f"round {round_index + 1} of {ROUNDS}"
            server.wait_all_blocks_free()
        hits = server.metric_by_node("pdserve_prefix_cache_hits_total")
        assert sum(v for node, v in hits.items() if node.startswith("prefill")) > 0, hits
        if "auto" in layout:  # prompts of 18-130 tokens: some computed on each side
            placed = server.metric_by_label("pdserve_prefill_placements_total", "placement")
            assert placed.get("local", 0) > 0 and placed.get("remote", 0) > 0, placed
    finally:
        server.close()


@pytest.mark.default_model
def test_default_model_disaggregated_chat_equals_colocated(pdserve_server, default_model_dir):
    """`pdserve serve` (1 prefill + 1 decode, the default) and 2 prefill + 2 decode against a
    colocated server (which prefills in 32-token chunks)."""
    questions = [
        "What is the capital of France?",
        "Name three colours.",
        "Count to five.",
        "Write a haiku about the sea.",
        "What is 2 + 2?",
        "Say hello in Spanish.",
    ]
    bodies = [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": q},
            ],
            "max_tokens": 24,
            "temperature": 0,
        }
        for q in questions * 2
    ]

    def answers(url: str) -> list[str]:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=300) as http:
                name = (await http.get("/v1/models")).json()["data"][0]["id"]

                async def one(body):
                    r = await http.post("/v1/chat/completions", json={**body, "model": name})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["message"]["content"]

                return await asyncio.gather(*(one(b) for b in bodies))

        return asyncio.run(main())

    colocated = Server(default_model_dir, "--colocated")
    try:
        expected = answers(colocated.url)
    finally:
        colocated.close()
    assert "Paris" in expected[0]
    assert answers(pdserve_server) == expected
    two_by_two = Server(default_model_dir, "--prefill", "2", "--decode", "2")
    try:
        assert answers(two_by_two.url) == expected
        two_by_two.wait_all_blocks_free()
    finally:
        two_by_two.close()


def test_requests_sharing_a_system_prompt_go_to_the_prefill_node_that_cached_it(tiny_llama_dir):
    rng = random.Random(4)
    systems = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(4)]
    server = Server(tiny_llama_dir, "--prefill", "2", "--decode", "1")
    try:
        # Ready means one node of each role; on a busy host the second prefill node may join
        # after the whole workload ran on the first.
        wait_until(lambda: len(live_nodes(server.url)) == 3, 120, "3 live nodes")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            name = http.get("/v1/models").json()["data"][0]["id"]
            for _ in range(5):
                for system in systems:
                    prompt = system + [rng.randrange(3, 500) for _ in range(8)]
                    body = {"model": name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
                    assert http.post("/v1/completions", json=body).status_code == 200
        server.wait_all_blocks_free()
        ideal = 4 * 4 * 64  # every request after a prompt's first reuses its 64 tokens

        def prefill_hits() -> float:
            hits = server.metric_by_node("pdserve_prefix_cache_hits_total")
            return sum(v for n, v in hits.items() if n.startswith("prefill"))

        wait_until(lambda: prefill_hits() >= 0.9 * ideal, 30, "prefix cache hits on prefill nodes")
        queries = server.metric_by_node("pdserve_prefix_cache_queries_total")
        prefill_queries = [v for n, v in queries.items() if n.startswith("prefill")]
        assert len(prefill_queries) == 2 and min(prefill_queries) > 0, "one node got everything"
    finally:
        server.close()


def test_a_prefill_node_started_alone_joins_the_router_and_serves(tiny_llama_dir):
    router_address = f"tcp://127.0.0.1:{free_port()}"
    secret = "e2e-joiner-cluster-secret"
    server = Server(tiny_llama_dir, "--router-listen", router_address, "--cluster-secret", secret)
    joiner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.commands.cli",
            "prefill",
            "--model",
            str(tiny_llama_dir),
            "--node-id",
            "joiner",
            "--listen",
            "tcp://127.0.0.1:0",  # the OS picks the port; the node reports it
            "--router",
            router_address,
            "--kv-cache-memory",
            str(32 << 20),
            "--dtype",
            "float32",
        ],
        env={**os.environ, "PDSERVE_CLUSTER_SECRET": secret},
    )
    try:
        def joined() -> bool:
            assert joiner.poll() is None, "the joining node exited"
            return "joiner" in server.metric_by_node("pdserve_num_requests_waiting")

        wait_until(joined, 120, "the prefill node joining")
        answers = run_concurrently(server.url, requests_with_shared_prefixes(8))
        assert all(tokens > 0 for _, tokens in answers)
        wait_until(
            lambda: server.metric_by_node("pdserve_prefix_cache_queries_total").get("joiner", 0),
            30,
            "a request reaching the joined prefill node",
        )
        server.wait_all_blocks_free()
    finally:
        joiner.send_signal(signal.SIGINT)
        joiner.wait(30)
        server.close()
