"""The router's early refusals: 429 to a request the router has no room for, before FastAPI
routes it and before its body is read, parsed or tokenized.

Under a burst most requests are refused, so a refusal's cost is what bounds how fast the router
answers them all. `OverloadChecks` says which checks guard which path; two places consult it:
  the router's own HTTP connections (router/api/http_connection.py, through
        router/api/early_refusal.py): a refusal is written as the request's head completes,
        with no ASGI task, middleware or response object: the path the router's server takes
  `OverloadGate`, a pure ASGI middleware, the innermost of the app's own (inside the access
        log, the request guard and the API-key check): the same refusal for a request that
        reached the app (under any ASGI server, in tests, or where the connection could not
        answer early: a pipelined request behind an unfinished answer, a key to check)
Both refusals live in router/cluster/admission.py. The checks, by path (POST only):
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
from pdserve.router.api.route_path import route_path
from pdserve.router.errors import APIError
from pdserve.router.state import RouterState


class OverloadChecks:
    def __init__(self, state: RouterState) -> None:
        admission, client = state.admission, state.client
        generation_checks = (admission.check_room, client.check_overload)
        tokenizer_checks = (admission.check_room,)
        self.by_path: dict[str, tuple[Callable[[], None], ...]] = {
            "/v1/completions": generation_checks,
            "/v1/chat/completions": generation_checks,
            "/tokenize": tokenizer_checks,
            "/detokenize": tokenizer_checks,
        }

    def guards(self, method: str, path: str) -> bool:
        return method == "POST" and path in self.by_path

    def refusal(self, method: str, path: str) -> APIError | None:
        """The error a request to `path` is refused with now, or None where it may go on."""
        if method != "POST":
            return None
        try:
            for check in self.by_path.get(path, ()):
                check()
        except APIError as error:
            return error
        return None


class OverloadGate:
    def __init__(
        self, app: ASGIApp, state: RouterState, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.on_error = on_error
        self.checks = OverloadChecks(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.checks.refusal(scope["method"], route_path(scope))
            if error is not None:
                if self.on_error is not None:
                    self.on_error(error.type)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
