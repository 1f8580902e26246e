"""The router's FastAPI app: `create_app(config)` builds everything (tokenizer, node client,
metrics; router/state.py) per app; nothing is module-global.

Routes (handlers in router/api/routes.py and router/api/tokenization.py): POST /v1/completions,
POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model_id}, POST /tokenize,
POST /detokenize, GET /health, GET and POST /ping (vLLM's and SageMaker's probe: /health's
answer), GET /version, GET /metrics; and the launcher's admin routes under /admin/
(router/api/admin.py: loopback clients with the cluster's admin token only).

Every request runs behind `access_log.AccessLog` (its request id, `x-request-id`, and its
access line) and, inside it, Starlette's CORSMiddleware, as vLLM's (`--allowed-origins`,
`--allowed-methods`, `--allowed-headers`, `--allow-credentials`; every origin by default): it
answers a browser's preflight (OPTIONS with `Access-Control-Request-Method`) itself, before any
API-key check, and adds the CORS headers to every other answer, errors included. Inside it runs
`error_handling.RequestGuard`: an unexpected exception is a 500 JSON answer on a connection that
stays usable, and a generation is closed (its admission places and node sub-requests given
back) when its request ends, however it ends. Inside it runs the API-key check
(router/api/auth.py), and inside that the early refusals under overload
(router/api/overload_gate.py), before FastAPI routes the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from pdserve.router.api import routes, tokenization
from pdserve.router.api.access_log import AccessLog
from pdserve.router.api.admin import add_admin_routes
from pdserve.router.api.auth import APIKeyMiddleware
from pdserve.router.api.error_handling import RequestGuard, install_error_handlers
from pdserve.router.api.overload_gate import OverloadGate
from pdserve.router.config import RouterConfig
from pdserve.router.state import RouterState


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
    app.add_middleware(OverloadGate, state=state, on_error=state.metrics.error)  # innermost
    app.add_middleware(
        APIKeyMiddleware, api_key=config.api_key, every_route=config.api_key_guards_every_route,
        on_error=state.metrics.error,
    )
    app.add_middleware(RequestGuard, on_error=state.metrics.error)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins,
            allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
            allow_credentials=config.allow_credentials,
        )
    app.add_middleware(AccessLog, enabled=config.log_requests)  # added last: outermost
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/tokenize", tokenization.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenization.detokenize, methods=["POST"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ping", routes.health, methods=["GET", "POST"])
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    add_admin_routes(app)
    return app
