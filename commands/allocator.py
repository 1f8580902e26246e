"""The memory allocator a CPU deployment's processes run with: tcmalloc where the host has it
(`make install` installs Debian's libtcmalloc-minimal4), preloaded into the router and every
node `pdserve serve` starts; the C library's malloc where it is absent.

Measured, not assumed (docs/performance.md, "Allocator and OpenMP"): on a 2-core AMD EPYC held
to AVX2, fp32, tcmalloc gave colocated pdserve 1.08-1.12x the output tokens/s at 1, 16 and 64
streams, and on Zen 4 as it is 1.01-1.31x (bf16 colocated, int8 1P+1D), side by side in
one run each. Intel's OpenMP preloaded as well (what vLLM's CPU docs ask)
left every pdserve process on one core, 0.57-0.73x the tokens/s, so it is not preloaded.

Not preloaded on a GPU host (not measured there), nor where the environment already sets
LD_PRELOAD (the operator's choice stands), nor with `PDSERVE_ALLOCATOR=system`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

#: Where Debian and Ubuntu (`apt install libtcmalloc-minimal4`) and Red Hat put tcmalloc.
TCMALLOC_PLACES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
ALLOCATOR_ENV = "PDSERVE_ALLOCATOR"
#: how `pdserve serve` begins its line naming the allocator (bench/vs_peers.py reads it back)
ALLOCATOR_LINE = "pdserve: processes allocate with "
CHOICES = ("auto", "system")


def find_tcmalloc(places: tuple[str, ...] = TCMALLOC_PLACES) -> str | None:
    """The first of `places` that exists, or None."""
    return next((place for place in places if Path(place).exists()), None)


def allocator_environment(
    environ: Mapping[str, str], on_gpus: bool, places: tuple[str, ...] = TCMALLOC_PLACES
) -> tuple[dict[str, str], str]:
    """The variables to add to each child's environment, and a line saying which allocator the
    deployment runs with and why. ValueError naming PDSERVE_ALLOCATOR when it is not one of
    CHOICES."""
    choice = environ.get(ALLOCATOR_ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{ALLOCATOR_ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "system":
        return {}, f"the C library's malloc ({ALLOCATOR_ENV}=system)"
    if environ.get("LD_PRELOAD"):
        return {}, "LD_PRELOAD as the environment sets it"
    if on_gpus:
        return {}, "the C library's malloc (GPU host)"
    tcmalloc = find_tcmalloc(places)
    if tcmalloc is None:
        return {}, "the C library's malloc (no tcmalloc: `apt install libtcmalloc-minimal4`)"
    return {"LD_PRELOAD": tcmalloc}, f"tcmalloc ({tcmalloc})"
