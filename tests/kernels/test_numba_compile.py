"""kernels/numba_compile.py: a cached kernel that calls a kernel of another file is compiled
anew when only that other file changes (numba alone would load its stale machine code), and
is loaded from the cache while nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

CALLER = """
    from callee import value
    from pdserve.kernels.numba_compile import compiled

    def twice():
        return 2 * value()

    twice = compiled(twice)
    print(twice(), len(twice.stats.cache_hits))
"""
CALLEE = """
    from numba import njit

    @njit
    def value():
        return {value}
"""


def run_caller(folder: Path) -> tuple[int, int]:
    """(what the cached kernel returns, how many of its signatures came from the cache)."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    env.pop("NUMBA_CACHE_DIR", None)  # the cache beside the sources, as in a checkout
    said = subprocess.run(
        [sys.executable, "-P", "-c", "import caller"], cwd=folder, env=env, check=True,
        capture_output=True, text=True, timeout=300,
    ).stdout.split()
    return int(said[0]), int(said[1])


def test_a_kernel_is_compiled_anew_when_only_a_kernel_it_calls_changes(tmp_path):
    (tmp_path / "caller.py").write_text(textwrap.dedent(CALLER))
    callee = tmp_path / "callee.py"
    callee.write_text(textwrap.dedent(CALLEE).format(value=1))
    assert run_caller(tmp_path) == (2, 0)  # compiled, then cached
    assert run_caller(tmp_path) == (2, 1)  # loaded from the cache
    callee.write_text(textwrap.dedent(CALLEE).format(value=5))
    assert run_caller(tmp_path) == (10, 0)  # numba's own stamp of caller.py did not change
