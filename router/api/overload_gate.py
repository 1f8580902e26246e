"""The router's early refusals: a pure ASGI middleware, the innermost of the app's own (inside
the access log, the request guard and the API-key check), that answers 429 to a request the
router has no room for before FastAPI routes it and before its body is read, parsed or
tokenized.

Under a burst most requests are refused, so a refusal's cost is what bounds how fast the router
answers them all: here it is a path lookup and the admission checks, not FastAPI's routing,
dependency solving and exception handlers. Both refusals live in router/cluster/admission.py.
The checks, by path (POST only):
  /v1/completions, /v1/chat/completions
        the admission queue at one of its bounds (`AdmissionQueue.check_room`), or every node
        that could compute the prompt past the queue-delay bound, counting the requests still
        being read and tokenized (`NodeClient.check_overload`, through `QueueDelayBound`)
  /tokenize, /detokenize
        the admission queue at one of its bounds
Any other request passes untouched; so does one that passes its checks, and its route takes it
from there (router/api/routes.py).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.api.error_handling import error_response
from pdserve.router.errors import APIError
from pdserve.router.state import RouterState


class OverloadGate:
    def __init__(
        self, app: ASGIApp, state: RouterState, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.on_error = on_error
        admission, client = state.admission, state.client
        generation_checks = (admission.check_room, client.check_overload)
        tokenizer_checks = (admission.check_room,)
        self.checks: dict[str, tuple[Callable[[], None], ...]] = {
            "/v1/completions": generation_checks,
            "/v1/chat/completions": generation_checks,
            "/tokenize": tokenizer_checks,
            "/detokenize": tokenizer_checks,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            try:
                for check in self.checks.get(scope["path"], ()):
                    check()
            except APIError as error:
                if self.on_error is not None:
                    self.on_error(error.type)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
