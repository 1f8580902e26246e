"""The router's HTTP handlers, plain functions that find their app's state as
`request.app.state.router` (router/state.py); `create_app` (router/api/app.py) registers them.

Request flow of the completions routes: admission queue full, or every node that could
compute the prompt already past the queue-delay bound, counting the requests still being read
and tokenized (429, before any parsing or tokenization, and before FastAPI routes the request:
router/api/overload_gate.py) -> read the body (413/400; the server bounds how long it may take) -> validate
(400: types, then parameters not implemented, router/api/unsupported.py; unknown fields logged)
-> model (404) -> (chat) prompt characters vs. context (400, without tokenizing:
`max_chars_per_token`) -> in a worker thread, never on the event loop: parameter checks and
the prompts' forms and number (400) -> a live node (503) -> (completions) each prompt's
characters vs. context -> chat template and tokenizing -> prompt ids vs. vocabulary and
context (400) -> back on the loop: draining after SIGTERM (503, router/api/drain.py) -> prompt and
completion vs. the largest live KV cache (400: it could never be served) -> admission queue
bounds (429) -> submit prompts x n sub-requests -> JSON or SSE answer. A client that goes away gets
every sub-request aborted; so does a stream whose client stops reading (router/api/sse.py,
router/generation.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from pdserve.router.api.access_log import request_record
from pdserve.router.api.body import read_json_object
from pdserve.router.api.content_parts import check_text_only
from pdserve.router.api.error_handling import at_request_end
from pdserve.router.api.responses import Responder
from pdserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.api.sse import EventStreamResponse
from pdserve.router.api.unsupported import check_not_implemented, known_fields, unknown_fields
from pdserve.router.api.validation import (
    Plan,
    check_kv_capacity,
    check_model,
    plan_chat,
    plan_completion,
)
from pdserve.router.errors import APIError, error_body, validation_error
from pdserve.router.generation import Generation
from pdserve.router.state import RouterState
from pdserve.text.reasoning_split import ReasoningStyle

logger = logging.getLogger(__name__)


async def completions(request: Request) -> Response:
    state: RouterState = request.app.state.router
    config = state.config
    with state.client.arriving():
        req = await read_request(request, state, CompletionRequest)
        plan = await state.tokenizer_threads.run(
            plan_completion, req, config, state.tokenizer, state.limits_now(),
            state.check_prompt_chars,
        )
    return await _generate(request, state, False, req, plan)


async def chat_completions(request: Request) -> Response:
    state: RouterState = request.app.state.router
    config = state.config
    with state.client.arriving():
        req = await read_request(request, state, ChatCompletionRequest)
        limits = state.limits_now()
        num_chars = sum(len(message.text()) for message in req.messages)
        state.check_prompt_chars(num_chars, limits, "messages")
        plan = await state.tokenizer_threads.run(plan_chat, req, config, state.tokenizer, limits)
    return await _generate(request, state, True, req, plan)


def _model_card(state: RouterState) -> dict[str, Any]:
    node = state.client.live_node()
    card: dict[str, Any] = {
        "id": state.config.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "pdserve",
        "root": state.config.model_name,  # never the folder: the host's paths stay private
        "parent": None,
    }
    if node is not None:
        card["max_model_len"] = node.stats.identity.max_model_len
    return card


def _check_serving(state: RouterState) -> None:
    """The model routes answer once a node can serve, as the completion routes do: a client
    that waits for `/v1/models` (as for a server that opens its port only when ready) is not
    then answered 503 by its first completion. Before, a 503 with `Retry-After`."""
    if not state.client.any_alive():
        raise APIError(503, "No inference node is available yet; try again later.")


async def models(request: Request) -> dict[str, Any]:
    state: RouterState = request.app.state.router
    _check_serving(state)
    return {"object": "list", "data": [_model_card(state)]}


async def model(request: Request, model_id: str) -> dict[str, Any]:
    """`GET /v1/models/{model_id}` (the id may hold slashes: a model path)."""
    state: RouterState = request.app.state.router
    check_model(model_id, state.config.model_names)
    _check_serving(state)
    return _model_card(state)


async def health(request: Request) -> Response:
    state: RouterState = request.app.state.router
    if state.draining:
        body = error_body("The server is shutting down.", "service_unavailable_error")
        return JSONResponse(body, status_code=503)
    if state.client.any_alive():
        return JSONResponse({"status": "ok"})
    body = error_body("No inference node is alive.", "service_unavailable_error")
    return JSONResponse(body, status_code=503)


async def version(request: Request) -> Response:
    """vLLM's `GET /version`: `{"version": "X.Y.Z"}`, pdserve's (wire/package_version.py)."""
    state: RouterState = request.app.state.router
    return JSONResponse({"version": state.version})


async def metrics(request: Request) -> Response:
    state: RouterState = request.app.state.router
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(list(error.errors(include_input=False))) from None


async def read_request(request: Request, state: RouterState, model: type[BaseModel]) -> Any:
    """The request of any POST route, read and parsed: its body (413/400), then 400 for a
    content part that is not text (router/api/content_parts.py), for a wrong type or for a
    parameter pdserve does not implement, a warning (once per name) for an
    unknown field (router/api/unsupported.py), and 404 for a model this server does not
    serve."""
    data = await read_json_object(request, state.config.max_body_bytes)
    check_text_only(data)
    req = _parse(model, data)
    check_not_implemented(data)
    state.unknown_fields.note(request.scope["path"], unknown_fields(data, known_fields(model)))
    check_model(req.model, state.config.model_names)
    return req


async def _generate(
    request: Request, state: RouterState, chat: bool, req: Any, plan: Plan
) -> Response:
    """Runs a planned request on the nodes and answers it as JSON or as an SSE stream."""
    config = state.config
    if state.draining:
        raise APIError(503, "The server is shutting down; retry on another replica.")
    check_kv_capacity(plan, state.kv_capacity())
    prefix = "chatcmpl" if chat else "cmpl"
    record = request_record(request.scope)
    generation = Generation(
        f"{prefix}-{uuid.uuid4().hex}",
        plan,
        state.client,
        state.tokenizer,
        state.metrics,
        state.admission,
        config.max_stream_buffer_tokens,
        arrived_at=record.arrived_at if record is not None else None,
    )
    if record is not None:
        record.generation = generation  # for the request's access line
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    reasoning = ReasoningStyle(config.reasoning_parser) if config.reasoning_parser else None
    formatter = state.formatter.as_token_ids() if req.return_tokens_as_token_ids else state.formatter
    responder = Responder(
        chat, generation, config.model_name, formatter, include_usage, reasoning,
        include_reasoning=getattr(req, "include_reasoning", True),
    )
    at_request_end(request.scope, generation.close)  # before start(): covers every exit
    generation.start()
    events = generation.events(request.receive, watch_until_first_event=req.stream)
    try:
        if not req.stream:
            return JSONResponse(await responder.collect(events))
        first = await anext(events)
    finally:
        if not req.stream:
            await events.aclose()
    response = EventStreamResponse(
        responder.stream(events, first),
        stall_timeout_s=config.stream_stall_timeout_s,
        on_stall=lambda: _stalled(state, generation, record.request_id if record else "-"),
    )
    generation.queue.writer_blocked = response.write_blocked
    return response


def _stalled(state: RouterState, generation: Generation, request_id: str) -> None:
    state.metrics.error("stream_stalled")
    logger.warning(
        "request %s (%s) aborted: its client read nothing for %.1f s",
        request_id,
        generation.request_id,
        state.config.stream_stall_timeout_s,
    )
