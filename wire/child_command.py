"""The command line that starts one of pdserve's own modules as a child Python process.

Every child pdserve starts (the router, each node, tensor-parallel ranks, KV peers, a server a
bench drives) runs `python -P -m pdserve.<folder>...`. `-P` (safe path) keeps the working
directory off the child's `sys.path`: started from a checkout, a bare `import kernels` would
otherwise find the checkout's `kernels/` folder before the installed package of that name (as
transformers' own `kernels` dependency does). Inside the child, pdserve's folders are found only
as `pdserve.<folder>`, through the installed distribution.
"""

from __future__ import annotations

import sys


def python_module_command(module: str) -> list[str]:
    """argv that runs `module` (a dotted `pdserve.` name) with this interpreter in safe-path mode."""
    if not module.startswith("pdserve."):
        raise ValueError(f"child module {module!r} is not one of pdserve's (pdserve.<folder>...)")
    return [sys.executable, "-P", "-m", module]
