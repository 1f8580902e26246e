"""The compiled CPU kernels' tests again, with numba compiling for instruction sets other than
this machine's, so that a path users run on other CPUs is tested on every machine: AVX2 + FMA
(Intel Haswell to Ice Lake client parts, AMD Zen 1-3: no AVX-512) and the x86-64 baseline
(SSE2). The int8, panel and 4-bit linears, the fp32 decode step, int8 and fp32 weights
(tests/engine/test_fp32_decode_step.py: whole tiny engines), and the fp32 decode batch step (the float32 cases of
tests/engine/test_compiled_decode.py) run under AVX2, the instruction set of most CPUs without
AVX-512. Each runs in a child pytest with NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set and a cache
directory of that CPU name's own, so every kernel is compiled for that target (a kernel's cache
entry is keyed by its target too) and once for the targets that share it. The bf16 kernels need AVX512-BF16 (kernels/cpu_gemv.py) and turn
themselves off under a named target: the engine keeps its torch path there, as on such a CPU.

Inside the child, test_cpu_int8_linear.py checks the registers the int8 kernels were compiled
with, so a target that did not take effect fails.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
AVX2 = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma"}
# target: (numba's settings, test files, pytest's -k selection)
TARGETS = {
    "avx2": (
        AVX2,
        ["test_cpu_int8_linear.py", "test_cpu_panel_linear.py", "test_cpu_int4_linear.py",
         "test_cpu_decode_attention.py", "../engine/test_fp32_decode_step.py"],
        None,
    ),
    "avx2-fp32-decode-batch": (AVX2, ["../engine/test_compiled_decode.py"], "float32"),
    "x86-64": (
        {"NUMBA_CPU_NAME": "generic"},
        ["test_cpu_int8_linear.py", "test_cpu_panel_linear.py", "test_cpu_int4_linear.py"],
        None,
    ),
}


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets"
)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_kernels_pass_their_tests_compiled_for(target, tmp_path_factory):
    pytest.importorskip("numba")
    settings, files, selection = TARGETS[target]
    # one cache per target CPU: targets of the same instruction set share what they compile
    cache = tmp_path_factory.getbasetemp() / f"numba-{settings['NUMBA_CPU_NAME']}"
    tmp_path = tmp_path_factory.mktemp(target)
    env = {**os.environ, **settings, "NUMBA_CACHE_DIR": str(cache)}
    child = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         *(["-k", selection] if selection else []), *(str(TESTS / name) for name in files)],
        check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    said = child.stdout + child.stderr
    assert child.returncode == 0, said[-4000:]
    assert "skipped" not in said.splitlines()[-1], said[-2000:]
