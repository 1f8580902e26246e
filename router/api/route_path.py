"""The path a route matches: the request's path less the root path (`--root-path`).

Behind a proxy that strips a prefix, uvicorn puts the root path back in front of the path it
received (ASGI's `path` includes `root_path`) and Starlette's router takes it off again to
match a route. The router's own middleware (the API key, the overload checks, the access
line's unlogged paths) and the connection's early refusal decide by route, so they take it off
the same way.
"""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    return without_root_path(scope.get("path", ""), scope.get("root_path", ""))


def without_root_path(path: str, root_path: str) -> str:
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path):]
    return path
