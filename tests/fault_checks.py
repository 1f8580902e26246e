"""Helpers for fault-injection tests against a real `pdserve serve`: streaming clients that time
every event, the launcher's child processes, and the leak check every scenario ends with.

`assert_no_leaked_blocks(url)` waits until every live node's KV cache is idle again (usage 0)
and none reports leaked blocks (`pdserve_kv_leaked_blocks`, from each node's idle-time
integrity check), nor was found out of integrity.

Tests order their steps by waiting for the event itself (`wait_until`, `wait_until_async`: a
log line, a /metrics value, a process state), with deadlines generous enough for a machine
whose every core is busy (`make test-stress`), never by a sleep that assumes it happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.node_metrics import parse_metric, wait_for_clean_kv
from pdserve.node.config import CONFIG_ENV

SHM_DIR = Path("/dev/shm")
HEARTBEAT_S = 0.5  # the nodes' default --heartbeat-interval
# An idle node sends NodeStats and runs its leak check once per heartbeat: within this many, the
# router's view of every node is one taken after its requests ended and after a leak check.
SETTLED_HEARTBEATS = 4


def metric(url: str, name: str, label: str = "node") -> dict[str, float]:
    return parse_metric(httpx.get(f"{url}/metrics", timeout=10).text, name, label)


def live_nodes(url: str) -> set[str]:
    return {node for node, up in metric(url, "pdserve_node_up").items() if up == 1.0}


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1) -> float:
    """Polls `predicate` until true; returns the seconds it took; fails naming `what`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} did not happen within {timeout} s"
        time.sleep(interval)
    return time.monotonic() - start


async def wait_until_async(predicate, timeout: float, what: str, interval: float = 0.05) -> float:
    """`wait_until` inside an event loop: the blocking `predicate` (reading a log or /metrics)
    runs in a thread, so the loop's own requests keep moving meanwhile."""
    start = time.monotonic()
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() - start < timeout, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(interval)
    return time.monotonic() - start


def assert_no_leaked_blocks(url: str, timeout: float = 60.0) -> None:
    """Every live node's KV usage returns to 0 and its leak check reports 0 leaked blocks, in
    every scrape for SETTLED_HEARTBEATS heartbeats (bench/node_metrics.py says why)."""
    settle = wait_for_clean_kv(url, SETTLED_HEARTBEATS * HEARTBEAT_S, timeout)
    assert settle["clean"], (
        f"the live nodes were not all idle without leaked KV blocks within {timeout} s: "
        f"{settle['nodes']}"
    )


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    ended_at: float = 0.0
    events: int = 0
    done: bool = False  # the `data: [DONE]` line arrived
    token_times: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None


async def stream_completion(
    http: httpx.AsyncClient, body: dict, result: StreamResult | None = None
) -> StreamResult:
    """One streaming completion, every event timed into `result` as it arrives (so a test can
    watch streams in progress); never raises for an HTTP or SSE error."""
    result = result if result is not None else StreamResult()
    try:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.done = True
                    break
                payload = json.loads(line[len("data: "):])
                result.events += 1
                if "error" in payload:
                    result.error = payload["error"]["message"]
                    continue
                choice = payload["choices"][0]
                if choice["text"]:
                    now = time.monotonic()
                    result.first_token_at = result.first_token_at or now
                    result.token_times.append(now)
                result.text += choice["text"]
                result.finish_reason = choice["finish_reason"] or result.finish_reason
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        result.ended_at = time.monotonic()
    return result


async def start_streams(
    http: httpx.AsyncClient, bodies: list[dict], ready, what: str, timeout: float = 60.0
) -> tuple[list[StreamResult], list[asyncio.Task]]:
    """Starts one streaming completion per body; returns their results (filling in as they
    stream) and tasks once `ready(results)` holds."""
    results = [StreamResult() for _ in bodies]
    tasks = [
        asyncio.create_task(stream_completion(http, body, result))
        for body, result in zip(bodies, results)
    ]
    deadline = time.monotonic() + timeout
    while not ready(results):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.005)
    return results, tasks


def completion_texts(url: str, bodies: list[dict]) -> list[str]:
    """Non-streaming completions, all at once; every one must succeed."""

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def one(body: dict) -> str:
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(main())


def children_of(pid: int) -> list[int]:
    result = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(line) for line in result.stdout.split()]


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (a node's or server's clean shutdown), then SIGKILL if it has not exited
    within `timeout_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def node_pids(launcher_pid: int) -> dict[str, int]:
    """The launcher's children by node id (`router` for the router)."""
    pids = {}
    for pid in children_of(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        args = [a.decode() for a in argv]
        prefix = f"{CONFIG_ENV}=".encode()
        config = next((e[len(prefix):] for e in environ if e.startswith(prefix)), None)
        if "--node-id" in args:
            name = args[args.index("--node-id") + 1]
        elif config is not None:  # `pdserve serve` hands a node its settings as data
            name = json.loads(config)["node"]["node_id"]
        else:
            name = "router"
        pids[name] = pid
    return pids


def kill9(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def kv_segments(port: int) -> list[str]:
    """The shared-memory KV segments of the deployment serving on `port`."""
    return sorted(p.name for p in SHM_DIR.glob(f"pdserve-kv-*.{port}"))
