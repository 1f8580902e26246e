"""How the numba kernels are compiled: on first call, and cached on disk where they can be.

numba's cache=True keeps the machine code beside the source file when that folder is writable,
else in the user's cache directory, or in NUMBA_CACHE_DIR; each entry is kept per CPU name and
features, so a cache made under other instruction sets (tests/kernels/test_instruction_sets.py)
is never loaded here. Where no cache directory is writable numba refuses cache=True when the
function is decorated: then it is compiled in every process instead.

numba judges an entry fresh by its own source file's time stamp and size alone, yet a kernel's
machine code holds the code of every kernel it calls from other files (their njit functions,
intrinsics and overloads: the compiled decode step holds the 4-bit linear's). After an edit of
one of those alone (a `git pull` into an editable install), the stale code would load and read
the new layouts wrongly. So every entry's stamp also carries a digest of all the sources in its
function's folder (`sources_digest`; kernels/ for pdserve's): an edit of any kernel compiles
each anew, once.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path

from numba import njit


@functools.cache
def sources_digest(folder: Path) -> str:
    """sha256 of every Python source in `folder`, names and contents."""
    digest = hashlib.sha256()
    for source in sorted(folder.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def compiled(function: Callable, **options: object) -> Callable:
    """`function` compiled by numba's njit with `options`, cached on disk where numba can, its
    cache kept only while no source beside the function's changes."""
    try:
        dispatcher = njit(cache=True, **options)(function)
    except RuntimeError:  # no writable cache directory
        return njit(**options)(function)
    try:
        cache_file = dispatcher._cache._cache_file
        folder = Path(inspect.getfile(function)).resolve().parent
        cache_file._source_stamp = (cache_file._source_stamp, sources_digest(folder))
    except AttributeError:  # a numba that keeps its cache otherwise: no stale code, no cache
        return njit(**options)(function)
    return dispatcher
