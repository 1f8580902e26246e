"""The router's FastAPI app: `create_app(config)` builds everything (tokenizer, node client,
metrics) per app; nothing is module-global.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Request flow: admission queue full (429, before any parsing or tokenization) ->
read the body (413/400; the server bounds how long it may take) -> validate (400) -> model (404)
-> prompt characters vs. context (400, without tokenizing: `max_chars_per_token`) -> in a
worker thread, never on the event loop: parameter checks (400) -> a live node (503) -> chat
template and tokenizing -> prompt ids vs. vocabulary and context (400) -> back on the loop:
draining after SIGTERM (503, router/drain.py) -> prompt and completion vs. the largest live KV
cache (400: it could never be served) -> admission queue bounds (429) -> submit n sub-requests
-> JSON or SSE answer. A client that goes away gets every sub-request aborted; so does a
stream whose client stops reading (router/sse.py, router/generation.py).

Every request runs behind `errors.RequestGuard`: an unexpected exception is a 500 JSON answer
on a connection that stays usable, and a generation is closed (its admission places and node
sub-requests given back) when its request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from router.admission import AdmissionQueue
from router.auth import APIKeyMiddleware
from router.body import read_json_object
from router.config import RouterConfig
from router.errors import (
    APIError,
    RequestGuard,
    at_request_end,
    error_body,
    install_error_handlers,
    invalid,
    validation_error,
)
from router.generation import Generation
from router.logprobs import LogprobFormatter
from router.metrics import RouterMetrics
from router.node_client import NodeClient
from router.node_registry import NodeState
from router.prompt_chars import max_chars_per_token
from router.responses import Responder
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.sse import EventStreamResponse
from router.validation import (
    KVCapacity,
    Limits,
    Plan,
    check_kv_capacity,
    check_model,
    plan_chat,
    plan_completion,
)
from text.tokenizer import load_tokenizer

# Threads that tokenize and apply chat templates (HF tokenizers release the GIL while they
# encode); the characters of a prompt are bounded before it gets there.
NUM_TOKENIZER_THREADS = 4

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


class WorkerThreads:
    """A few threads for the blocking work of a request (chat templates, tokenizing), so the
    event loop keeps serving every other request and stream meanwhile. Started on first use;
    `shutdown()` (at the app's shutdown) stops them, and a later use starts new ones."""

    def __init__(self, num_threads: int, name: str) -> None:
        self.num_threads = num_threads
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., Result], *args: Any) -> Result:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix=self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class RouterState:
    """Everything one app owns; reachable as `app.state.router` (tests inject NodeStats
    through `app.state.router.client.record_stats`)."""

    def __init__(self, config: RouterConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.tokenizer = (
            tokenizer if tokenizer is not None else load_tokenizer(Path(config.model_path))
        )
        self.metrics = RouterMetrics()
        self.admission = AdmissionQueue(config, self.metrics.registry)
        self.client = NodeClient(
            config.node_addresses,
            config.listen_address,
            config.node_timeout_s,
            on_stats=self._on_stats,
            on_liveness=self._on_liveness,
            on_retry=self.metrics.request_retries.inc,
            cluster_auth=config.cluster_auth,
            max_queue_delay_s=config.max_queue_delay_s,
        )
        self.formatter = LogprobFormatter(self.tokenizer)
        self.tokenizer_threads = WorkerThreads(NUM_TOKENIZER_THREADS, "router-tokenize")
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM (router/drain.py): new requests get 503

    def _on_stats(self, node: NodeState) -> None:
        self.metrics.observe_node(node.node_id or node.address, node.stats)

    def _on_liveness(self, node: NodeState) -> None:
        self.metrics.observe_liveness(node.node_id or node.address, node.role or "", node.up)

    def limits(self) -> tuple[int, int]:
        node = self.client.live_node()
        if node is None:
            raise APIError(503, "No inference node is available; try again later.")
        return node.stats.max_model_len, node.stats.vocab_size

    def limits_now(self) -> Limits:
        """`limits()` read now, on the event loop (it reads the node registry), as a function
        that gives the same answer, or raises the same 503, later and from any thread."""
        try:
            known = self.limits()
        except APIError as error:
            no_node = error

            def unavailable() -> tuple[int, int]:
                raise no_node

            return unavailable
        return lambda: known

    def check_prompt_chars(self, num_chars: int, limits: Limits, param: str) -> None:
        """400 for a prompt of more characters than the model's context can hold as tokens,
        decided without tokenizing it. Skipped when the tokenizer gives no bound per token,
        or when no node is alive (the request's plan answers that)."""
        if self.max_chars_per_token is None:
            return
        try:
            max_model_len, _ = limits()
        except APIError:
            return
        max_chars = max_model_len * self.max_chars_per_token
        if num_chars > max_chars:
            raise invalid(
                f"This model's maximum context length is {max_model_len:,} tokens. However, "
                f"'{param}' has {num_chars:,} characters of text, more than {max_model_len:,} "
                f"tokens can hold (a token of this model stands for at most "
                f"{self.max_chars_per_token} characters). Please reduce the length of the "
                f"{param}.",
                param,
            )

    def kv_capacity(self) -> KVCapacity:
        """The largest KV caches (in blocks) of the live nodes that would serve a request."""
        registry = self.client.registry
        prefill = registry.live("prefill")
        serving = registry.live("decode") if prefill else []
        if not serving:
            serving, prefill = registry.live("colocated"), []
        stats = [n.stats for n in (*serving, *prefill)]
        return KVCapacity(
            block_size=max((s.block_size for s in stats), default=0),
            serving_blocks=max((n.stats.num_total_blocks for n in serving), default=0),
            prefill_blocks=max((n.stats.num_total_blocks for n in prefill), default=None),
        )


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(list(error.errors(include_input=False))) from None


def create_app(config: RouterConfig, tokenizer: Any = None) -> FastAPI:
    state = RouterState(config, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.client.start()
        try:
            yield
        finally:
            await state.client.stop()
            state.tokenizer_threads.shutdown()

    app = FastAPI(
        title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = state
    install_error_handlers(app, on_error=state.metrics.error)
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key, on_error=state.metrics.error)
    app.add_middleware(RequestGuard, on_error=state.metrics.error)  # added last: outermost

    async def run(request: Request, chat: bool, req: Any, plan: Plan) -> Response:
        if state.draining:
            raise APIError(503, "The server is shutting down; retry on another replica.")
        check_kv_capacity(plan, state.kv_capacity())
        prefix = "chatcmpl" if chat else "cmpl"
        generation = Generation(
            f"{prefix}-{uuid.uuid4().hex}",
            plan,
            state.client,
            state.tokenizer,
            state.metrics,
            state.admission,
            config.max_stream_buffer_tokens,
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        responder = Responder(chat, generation, config.model_name, state.formatter, include_usage)
        at_request_end(request.scope, generation.close)  # before start(): covers every exit
        generation.start()
        generation.poll_disconnect = request.is_disconnected
        events = generation.events()
        try:
            if not req.stream:
                return JSONResponse(await responder.collect(events))
            first = await anext(events)
        finally:
            generation.poll_disconnect = None
            if not req.stream:
                await events.aclose()
        response = EventStreamResponse(
            responder.stream(events, first),
            stall_timeout_s=config.stream_stall_timeout_s,
            on_stall=lambda: stalled(generation),
        )
        generation.queue.writer_blocked = response.write_blocked
        return response

    def stalled(generation: Generation) -> None:
        state.metrics.error("stream_stalled")
        logger.warning(
            "request %s aborted: its client read nothing for %.1f s",
            generation.request_id,
            config.stream_stall_timeout_s,
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state.admission.check_room()
        req = _parse(CompletionRequest, await read_json_object(request, config.max_body_bytes))
        check_model(req.model, config.model_name)
        limits = state.limits_now()
        if isinstance(req.prompt, str):
            state.check_prompt_chars(len(req.prompt), limits, "prompt")
        plan = await state.tokenizer_threads.run(
            plan_completion, req, config, state.tokenizer, limits
        )
        return await run(request, False, req, plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.admission.check_room()
        data = await read_json_object(request, config.max_body_bytes)
        req = _parse(ChatCompletionRequest, data)
        check_model(req.model, config.model_name)
        limits = state.limits_now()
        num_chars = sum(len(message.text()) for message in req.messages)
        state.check_prompt_chars(num_chars, limits, "messages")
        plan = await state.tokenizer_threads.run(plan_chat, req, config, state.tokenizer, limits)
        return await run(request, True, req, plan)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        node = state.client.live_node()
        card: dict[str, Any] = {
            "id": config.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "pdserve",
            "root": str(config.model_path),
            "parent": None,
        }
        if node is not None:
            card["max_model_len"] = node.stats.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            body = error_body("The server is shutting down.", "service_unavailable_error")
            return JSONResponse(body, status_code=503)
        if state.client.any_alive():
            return JSONResponse({"status": "ok"})
        body = error_body("No inference node is alive.", "service_unavailable_error")
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return app
