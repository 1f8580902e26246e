"""A serving deployment as separate processes, for the fault tests: prefill, decode (or
colocated) nodes and the router, each started with its own flags and environment (a fault
switch goes to the nodes only), logs in files, stopped and checked for leftovers on close.
The router computes every prompt of a decode node on a prefill node (`--disagg-policy always`)
unless `router_flags` names a policy: the faults are meant to hit both.

`Cluster.metric_by_node`, `metrics_by_node`, `wait_blocks_free` and `alive` read and check the
running deployment, `LogCursor` what a process logged since a moment; `http` is a minimal
asyncio HTTP/1.1 client light enough for a thousand concurrent requests from one test process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.wire.free_ports import free_port
from tests.fault_checks import assert_no_leaked_blocks

SHM_DIR = Path("/dev/shm")
MODEL_NAME = "tiny"


class Cluster:
    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *,
        colocated: bool = False,
        kv_transport: str = "shm",
        node_flags: tuple[str, ...] = (),
        prefill_flags: tuple[str, ...] = (),
        decode_flags: tuple[str, ...] = (),
        router_flags: tuple[str, ...] = (),
        node_env: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        router_address = f"tcp://127.0.0.1:{free_port()}"
        # fp32, as conftest's tiny_llm: the fault tests compare texts with its greedy ones.
        common = [
            "--model", str(model_dir), "--router", router_address,
            "--kv-cache-memory", str(32 << 20), "--dtype", "float32", *node_flags,
        ]
        if colocated:
            roles = [("colocated", [])]
        else:
            roles = [
                ("prefill", ["--kv-transport", kv_transport, *prefill_flags]),
                ("decode", ["--kv-transport", kv_transport, *decode_flags]),
            ]
        router_argv = [
            sys.executable, "-m", "pdserve.router", "--model", str(model_dir),
            "--served-model-name", MODEL_NAME, "--listen", router_address,
            "--port", str(self.port),
            *([] if "--disagg-policy" in router_flags else ["--disagg-policy", "always"]),
            *router_flags,
        ]
        node_env = {**os.environ, "OMP_NUM_THREADS": "1", **(node_env or {})}
        try:
            for role, flags in roles:
                node_id = f"{role}-{self.tag}"
                address = f"tcp://127.0.0.1:{free_port()}"
                self._start(role, [
                    sys.executable, "-m", "pdserve.node", role, "--node-id", node_id,
                    "--listen", address, "--num-threads", "1", *common, *flags,
                ], node_env)
                router_argv += ["--node", f"{node_id}={address}"]
            router_env = {
                k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_KV_FAULTS")
            }
            self._start("router", router_argv, router_env)
            self._wait_ready([f"{role}-{self.tag}" for role, _ in roles], ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{name}-{self.tag}.log", "w")  # noqa: SIM115 (closed later)
        self._logs.append(log)
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def _wait_ready(self, node_ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise RuntimeError(f"a process exited during start-up:\n{self.logs()}")
            try:
                healthy = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
                if healthy and set(node_ids) <= set(self.metric_by_node("pdserve_kv_cache_usage_ratio")):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ready in {timeout_s} s:\n{self.logs()}")
            time.sleep(0.25)

    # -- observation -------------------------------------------------------------------------

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes.values())

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}-{self.tag}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"== {n}\n{self.log(n)[-3000:]}" for n in self.processes)

    def metric_by_node(self, name: str) -> dict[str, float]:
        return self.metrics_by_node(name)[name]

    def metrics_by_node(self, *names: str) -> dict[str, dict[str, float]]:
        """Several metrics by node from one scrape: values of one node come from one NodeStats."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found: dict[str, dict[str, float]] = {name: {} for name in names}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name][sample.labels.get("node", "")] = sample.value
        return found

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def wait_blocks_free(self, timeout_s: float = 60.0) -> None:
        """Every node's KV usage back to 0 and its idle-time leak check at 0."""
        assert_no_leaked_blocks(self.url, timeout_s)
        usage = self.metric_by_node("pdserve_kv_cache_usage_ratio")
        assert len(usage) == len(self.processes) - 1 and not any(usage.values()), usage

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self._logs:
            log.close()
        leftovers = sorted(p.name for p in SHM_DIR.glob(f"pdserve-kv-*{self.tag}*"))
        assert not leftovers, f"shared-memory segments left behind: {leftovers}"


# -- a small HTTP/1.1 client -----------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    events: list[tuple[float, dict]] = field(default_factory=list)  # (arrival, SSE payload)
    elapsed_s: float = 0.0

    def json(self) -> dict:
        return json.loads(self.body)

    def text(self) -> str:
        """The completion text of a JSON body or of the SSE events (choice 0)."""
        if self.events:
            return "".join(
                (c.get("text") or c.get("delta", {}).get("content") or "")
                for _, e in self.events
                for c in e.get("choices", [])
            )
        choice = self.json()["choices"][0]
        return choice.get("text") or choice.get("message", {}).get("content") or ""

    @property
    def error(self) -> dict | None:
        """The error of a JSON error body or of an SSE error event."""
        if self.events:
            return next((e["error"] for _, e in self.events if "error" in e), None)
        if self.status != 200 and self.body:
            return self.json().get("error")
        return None


async def http(
    port: int, path: str, body: dict | None = None, *, timeout_s: float = 120.0
) -> Reply:
    """One request on its own connection (`Connection: close`); SSE bodies are split into
    events with their arrival times."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = json.dumps(body).encode() if body is not None else b""
        method = "POST" if body is not None else "GET"
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        reply = await asyncio.wait_for(_read_reply(reader), timeout_s)
        reply.elapsed_s = time.monotonic() - started
        return reply
    finally:
        writer.close()


async def read_head(reader: asyncio.StreamReader) -> Reply:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection without answering")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(int(status_line.split()[1]), headers)


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    reply = await read_head(reader)
    if "content-length" in reply.headers:
        reply.body = await reader.readexactly(int(reply.headers["content-length"]))
        return reply
    if reply.headers.get("transfer-encoding") != "chunked":
        reply.body = await reader.read()
        return reply
    pending = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            break
        pending += chunk[:-2]
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            reply.body += event + b"\n\n"
            payload = event.removeprefix(b"data: ")
            if payload != b"[DONE]":
                reply.events.append((time.monotonic(), json.loads(payload)))
    return reply


def completion(prompt: list[int], max_tokens: int, stream: bool = False, **extra) -> dict:
    return {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream, **extra,
    }


async def open_request(port: int, path: str, body: dict) -> tuple:
    """Sends a request and returns its (reader, writer) unread, for clients that misbehave."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode() + data
    )
    await writer.drain()
    return reader, writer


class LogCursor:
    """What a process wrote to its log since the cursor was made."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.offset = len(cluster.log(name))

    def text(self) -> str:
        return self.cluster.log(self.name)[self.offset:]

    def count(self, needle: str) -> int:
        return self.text().count(needle)


def greedy_texts(llm, requests) -> dict[tuple[int, ...], str]:
    """Reference text of each (prompt ids, max_tokens) request: greedy, EOS ignored."""
    from pdserve.engine import SamplingParams

    outputs = llm.generate(
        [list(p) for p, _ in requests],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests],
    )
    return {tuple(p): out.text for (p, _), out in zip(requests, outputs)}
