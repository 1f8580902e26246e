"""Graceful drain: SIGTERM to `pdserve serve` (real processes, tiny model, 1 prefill + 1 decode).

New requests get 503 at once; requests in flight finish (within `--drain-timeout`; past it they
end with an error event); then every child process exits, the launcher exits 0, and no shared
memory segment of the deployment remains.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx

from pdserve.commands.serve_process import ServeProcess
from tests.fault_checks import (
    StreamResult,
    alive,
    kv_segments,
    node_pids,
    stream_completion,
    wait_until,
)

FLAGS = [
    "--kv-cache-memory", str(32 << 20), "--prefill", "1", "--decode", "1",
    "--disagg-policy", "always",  # requests in flight on both nodes when the drain starts
]


def stream_bodies(model: str, count: int, max_tokens: int) -> list[dict]:
    rng = random.Random(7)
    return [
        {
            "model": model,
            "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(10, 40))],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(count)
    ]


async def _drain_while_streaming(server: ServeProcess, bodies: list[dict]):
    """Starts the streams, SIGTERMs the launcher once every stream has tokens, and checks that
    a new request gets 503 meanwhile. Returns the results and the time of the signal."""
    results = [StreamResult() for _ in bodies]
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(60)) as http:
        tasks = [
            asyncio.create_task(stream_completion(http, body, result))
            for body, result in zip(bodies, results)
        ]
        deadline = time.monotonic() + 60
        while not all(len(r.token_times) >= 2 for r in results):
            assert time.monotonic() < deadline, "the streams never started"
            await asyncio.sleep(0.01)
        signalled_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        probe = {**bodies[0], "max_tokens": 1}
        while True:  # the launcher forwards the signal to the router
            response = await http.post("/v1/completions", json=probe)
            if response.status_code == 503:
                break
            assert response.status_code == 200, response.text
            assert time.monotonic() - signalled_at < 5, "new requests were still served"
            await asyncio.sleep(0.05)
        assert "shutting down" in response.json()["error"]["message"]
        assert (await http.get("/health")).status_code == 503
        await asyncio.gather(*tasks)
    return results, signalled_at


def drain(server: ServeProcess, bodies: list[dict]) -> tuple[list[StreamResult], float]:
    children = node_pids(server.process.pid)
    assert len(children) == 3
    try:
        results, signalled_at = asyncio.run(_drain_while_streaming(server, bodies))
        assert server.process.wait(60) == 0
        wait_until(
            lambda: not any(alive(pid) for pid in children.values()), 5, "every child exiting"
        )
        assert kv_segments(server.port) == []
        return results, signalled_at
    finally:
        server.close()


def test_sigterm_lets_requests_in_flight_finish_and_leaves_nothing_behind(tiny_llama_dir):
    server = ServeProcess(["--model", str(tiny_llama_dir), *FLAGS, "--drain-timeout", "60"])
    # Long enough streams that they are still in flight when the probes see the 503 (with 200
    # tokens the tiny model could finish them, and the router exit, between two probes).
    results, _ = drain(server, stream_bodies(tiny_llama_dir.name, 8, 800))
    for result in results:
        assert result.completed and result.done and result.finish_reason == "length", result
        assert len(result.token_times) > 100


def test_requests_still_running_at_the_drain_timeout_end_with_an_error_event(tiny_llama_dir):
    drain_timeout_s = 1.0
    server = ServeProcess(
        ["--model", str(tiny_llama_dir), *FLAGS, "--drain-timeout", str(drain_timeout_s)]
    )
    results, signalled_at = drain(server, stream_bodies(tiny_llama_dir.name, 16, 900))
    cut = [r for r in results if not r.completed]
    assert cut, "every request finished within the drain timeout: nothing was tested"
    for result in cut:
        assert result.status == 200 and result.done and "shutting down" in result.error, result
        assert result.ended_at - signalled_at <= drain_timeout_s + 3.0
