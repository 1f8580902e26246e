"""What a CPU engine's allocator keeps: freed memory stays for reuse between steps, and
`release_free_memory` hands what loading freed back to the system, under glibc's malloc and
under tcmalloc (which `pdserve serve` preloads). Each case runs in a fresh Python, so the
allocator and the heap are the child's own."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pdserve.commands.allocator import find_tcmalloc

# In the child: 256 blocks of 1 MiB, written (so resident) and freed; the resident set after
# the frees, and after the release.
CHILD = """
import ctypes, json
from pdserve.engine.cpu.cpu_allocator import keep_freed_memory_for_reuse, release_free_memory

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

keep_freed_memory_for_reuse()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
start = resident_mib()
blocks = [libc.malloc(1 << 20) for _ in range(256)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
for block in blocks:
    libc.free(block)
freed = resident_mib()
allocator = release_free_memory()
print(json.dumps({"kept": freed - start, "after": resident_mib() - start, "allocator": allocator}))
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's Linux"
)
@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_freed_memory_is_kept_until_released_then_given_back(allocator):
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    if allocator == "tcmalloc":
        tcmalloc = find_tcmalloc()
        if tcmalloc is None:
            pytest.skip("no tcmalloc on this host (apt install libtcmalloc-minimal4)")
        env["LD_PRELOAD"] = tcmalloc
    child = subprocess.run(
        [sys.executable, "-P", "-c", CHILD], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    assert measured["allocator"] == allocator
    assert measured["kept"] > 200, measured  # freed, but still resident: kept for reuse
    assert measured["after"] < 64, measured  # handed back
