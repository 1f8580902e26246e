"""An OpenAI-API load generator: streamed completions sent at set arrival times, with per-request
TTFT, inter-token latencies, TPOT and end-to-end latency, and the summary statistics serving
benchmarks report (percentiles, throughput, goodput under an SLO)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadRequest:
    at: float
    prompt: list[int]
    max_tokens: int
    kind: str


@dataclass
class RequestTiming:
    kind: str
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def _one(http: httpx.AsyncClient, model: str, request: LoadRequest, start: float):
    await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
    sent = time.perf_counter()
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = RequestTiming(request.kind, ok=False)
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return timing
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            now = time.perf_counter()
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            if last is None:
                timing.ttft = now - sent
            else:
                timing.itls.append(now - last)
            last = now
    timing.e2e = time.perf_counter() - sent
    timing.ok = timing.output_tokens == request.max_tokens
    return timing


def run_load(url: str, requests: list[LoadRequest]) -> tuple[list[RequestTiming], float]:
    """Sends every request at its time; returns the timings and the wall time of the run."""

    async def main():
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            start = time.perf_counter()
            timings = await asyncio.gather(*(_one(http, model, r, start) for r in requests))
            return timings, time.perf_counter() - start

    return asyncio.run(main())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(
    timings: list[RequestTiming], wall: float, slo_ttft: float, slo_tpot: float
) -> dict[str, float]:
    done = [t for t in timings if t.ok]
    itls = [x for t in done for x in t.itls]
    good = [t for t in done if t.ttft <= slo_ttft and t.tpot <= slo_tpot]
    out = {
        "requests": len(timings),
        "completed": len(done),
        "throughput_tok_s": sum(t.output_tokens for t in done) / wall,
        "request_throughput": len(done) / wall,
        "goodput": len(good) / wall,
        "slo_attainment": len(good) / len(timings) if timings else 0.0,
    }
    for name, values in (
        ("ttft", [t.ttft for t in done]),
        ("tpot", [t.tpot for t in done if t.output_tokens > 1]),
        ("itl", itls),
        ("e2e", [t.e2e for t in done]),
    ):
        out[f"{name}_mean"] = statistics.fmean(values) if values else float("nan")
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q)
        out[f"{name}_max"] = max(values, default=float("nan"))
    return out
