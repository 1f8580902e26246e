"""How the numba kernels are compiled: on first call, and cached on disk where they can be.

numba's cache=True keeps the machine code beside the source file when that folder is writable,
else in the user's cache directory, or in NUMBA_CACHE_DIR; each entry is kept per CPU name and
features, so a cache made under other instruction sets (tests/kernels/test_instruction_sets.py)
is never loaded here. Where no cache directory is writable numba refuses cache=True when the
function is decorated: then it is compiled in every process instead.
"""

from __future__ import annotations

from collections.abc import Callable

from numba import njit


def compiled(function: Callable, **options: object) -> Callable:
    """`function` compiled by numba's njit with `options`, cached on disk where numba can."""
    try:
        return njit(cache=True, **options)(function)
    except RuntimeError:  # no writable cache directory
        return njit(**options)(function)
