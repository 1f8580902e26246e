"""An OpenAI-API load generator: streamed completions sent at set arrival times, with per-request
TTFT, inter-token latencies, TPOT and end-to-end latency.

Each request waits until its arrival offset, then for a free slot when `max_concurrency` is set;
its clock starts when it is sent. A request fails, and is recorded with the reason instead of
raising, on a non-200 answer, an error event in the stream, a broken connection or timeout, or
fewer tokens than asked for when EOS is ignored. Prompts are token-id lists sent to
/v1/completions; `endpoint="chat"` sends them as text (`to_text`) in one user message.
Summary statistics live in bench/serve_metrics.py (re-exported here).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdserve.bench.serve_metrics import percentile, summarize

__all__ = [
    "LoadOptions",
    "LoadRequest",
    "RequestTiming",
    "discover_model",
    "percentile",
    "run_load",
    "summarize",
]
ENDPOINTS = ("completions", "chat")
#: httpx's words for a reused connection that the server had closed before it answered
STALE_CONNECTION = "Server disconnected without sending a response"


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
    prompt_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadOptions:
    model: str | None = None
    endpoint: str = "completions"
    max_concurrency: int | None = None
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    to_text: Callable[[list[int]], str] | None = None
    on_done: Callable[[RequestTiming], None] | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint is {self.endpoint!r}; expected one of {ENDPOINTS}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency is {self.max_concurrency}; expected >= 1")
        if self.endpoint == "chat" and self.to_text is None:
            raise ValueError("--endpoint chat needs a tokenizer to turn prompts into text")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _body(model: str, request: LoadRequest, options: LoadOptions) -> tuple[str, dict]:
    body: dict = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": options.to_text(request.prompt)}]
        return "/v1/chat/completions", body
    body["prompt"] = request.prompt
    return "/v1/completions", body


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _stream(http: httpx.AsyncClient, path: str, body: dict, timing: RequestTiming) -> None:
    """Fills `timing` from the SSE stream; token arrivals are the chunks that carry text."""
    sent = time.perf_counter()
    last, text_chunks = None, 0
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            timing.error = f"HTTP {response.status_code}: {detail}"
            return
        async for line in response.aiter_lines():
            payload = line[len("data:") :].strip() if line.startswith("data:") else ""
            if not payload or payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            now = time.perf_counter()
            if chunk.get("error"):
                timing.error = f"error event: {json.dumps(chunk['error'])[:200]}"
                return
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"].get("completion_tokens", 0)
                timing.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            if not chunk.get("choices") or not _chunk_text(chunk["choices"][0]):
                continue
            text_chunks += 1
            if last is None:
                timing.ttft = now - sent
            else:
                timing.itls.append(now - last)
            last = now
    timing.e2e = time.perf_counter() - sent
    timing.output_tokens = timing.output_tokens or text_chunks
    if last is None:
        timing.error = "no text was streamed"


async def _send(http: httpx.AsyncClient, path: str, body: dict, timing: RequestTiming) -> None:
    """`_stream`, sent once more when the server closed a reused keep-alive connection before
    answering. llama.cpp's server closes its connection after every streamed answer, at times
    only after the client has sent its next request on it; that request was never read, so it
    goes again on a fresh connection, its clock restarted."""
    try:
        await _stream(http, path, body, timing)
    except httpx.RemoteProtocolError as error:
        if STALE_CONNECTION not in str(error):
            raise
        await _stream(http, path, body, timing)


async def _one(
    http: httpx.AsyncClient,
    model: str,
    request: LoadRequest,
    options: LoadOptions,
    start: float,
    slots: asyncio.Semaphore | None,
) -> RequestTiming:
    await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
    timing = RequestTiming(request.kind, ok=False, prompt_tokens=len(request.prompt))
    path, body = _body(model, request, options)
    try:
        if slots is None:
            await _send(http, path, body, timing)
        else:
            async with slots:
                await _send(http, path, body, timing)
    except Exception as error:  # noqa: BLE001 - one bad answer must not end the whole run
        timing.error = f"{type(error).__name__}: {error}"[:200]
    if not timing.error and options.ignore_eos and timing.output_tokens != request.max_tokens:
        timing.error = f"{timing.output_tokens} of {request.max_tokens} tokens"
    timing.ok = not timing.error
    if options.on_done is not None:
        options.on_done(timing)
    return timing


def discover_model(url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise ValueError(
            f"could not read a model id from {url}/v1/models ({error}); pass --model"
        ) from error


def run_load(
    url: str, requests: list[LoadRequest], options: LoadOptions | None = None
) -> tuple[list[RequestTiming], float]:
    """Sends every request at its time; returns the timings (in request order) and the wall
    time from the first send to the last answer."""
    options = options or LoadOptions()
    model = options.model or discover_model(url, options.api_key)

    async def main() -> tuple[list[RequestTiming], float]:
        limit = max(1, min(len(requests), options.max_concurrency or len(requests)))
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        slots = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        async with httpx.AsyncClient(
            base_url=url, timeout=options.timeout_s, limits=limits, headers=options.headers()
        ) as http:
            start = time.perf_counter()
            timings = await asyncio.gather(
                *(_one(http, model, r, options, start, slots) for r in requests)
            )
            return list(timings), time.perf_counter() - start

    return asyncio.run(main())
