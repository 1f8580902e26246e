"""Keeps large CPU activations out of fresh mmap()s (glibc only), and gives back, once, what
loading the model freed.

glibc serves allocations above 128 KiB with mmap() and returns them on free(), so every step's
activations page-fault in anew: a [2048, 576] fp32 RMSNorm took 4.0 ms that way against 0.23 ms
with reused memory, and whole prefill steps run 15% faster with it (measured on this project's
2-core CPU). Raising the mmap threshold to glibc's maximum (32 MiB) and never trimming the heap
keeps freed memory for the next step. Process-wide and idempotent; a no-op off glibc.

The same never-trimmed heap (and tcmalloc, which `pdserve serve` preloads, on its own) keeps
what loading and packing the weights freed: the checkpoint's tensors, each layout's staging
copies. On the default model in fp32 that is 0.8 GB a node holds for nothing, a third of its
memory. `release_free_memory`, called once the runner is built, returns those free pages to the
system; the steps' activations fault in once more on the first steps, then stay.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
_NEVER_TRIM = 2**31 - 1
_TOP_PAD = 64 << 20


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc on Linux (whose malloc these tune), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def keep_freed_memory_for_reuse() -> bool:
    """Tunes glibc malloc for a long-running engine; returns whether it applied."""
    libc = _glibc()
    if libc is None:
        return False
    applied = all(
        libc.mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
            (_M_TRIM_THRESHOLD, _NEVER_TRIM),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )
    if not applied:
        logger.warning("glibc refused the malloc tuning; large activations will page-fault")
    return applied


def release_free_memory() -> str | None:
    """Returns the allocator's free pages to the system, once: tcmalloc's where it is loaded
    (`MallocExtension_ReleaseFreeMemory`), else glibc's (`malloc_trim`). The allocator it asked,
    or None where it knows neither."""
    process = ctypes.CDLL(None)
    tcmalloc_release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if tcmalloc_release is not None:
        tcmalloc_release()
        return "tcmalloc"
    libc = _glibc()
    if libc is None:
        return None
    libc.malloc_trim(0)
    return "glibc"
