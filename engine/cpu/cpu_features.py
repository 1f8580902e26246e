"""Which bf16 matrix instructions this CPU has, detected once per process at run time.

Two readers: `dtype="auto"` (engine/cpu/dtype_choice.py) runs the model in bf16 on a CPU that
multiplies bf16 matrices natively and in fp32 elsewhere, and `Linear.pack()`
(engine/layers/linear.py) prepacks bf16 weights for oneDNN only on such a CPU. "Natively" means
AMX-BF16 (tile matrix multiply: Intel Sapphire Rapids and later) or AVX512-BF16 (bf16 dot
products in vector registers: Intel Cooper Lake, AMD Zen 4 and later). Without either, torch
still runs bf16 everywhere, emulated through fp32, with no speed to show for the lost
precision: an AMD Zen 3 or an older Intel CPU stays in fp32 under "auto".

Detection asks torch first (`torch.cpu._is_amx_tile_supported()` and
`_is_avx512_bf16_supported()`, private helpers that also check that the OS enabled the AMX
registers; every CPU with AMX tiles so far has AMX-BF16), and reads the `flags` line of
/proc/cpuinfo when this torch lacks them. A CPU it cannot read (macOS, another architecture)
counts as having neither. oneDNN, which runs the matmuls, may be held below the CPU
(`ONEDNN_MAX_CPU_ISA=AVX2`, as when a bigger CPU stands in for an AVX2 one): then it packs no
bf16 weight, and the instructions count as absent (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`
says so, honouring the cap).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuFeatures:
    """The bf16 instructions found, and where the answer came from ("torch", "/proc/cpuinfo"
    or "unknown"). Tests build one directly to choose a dtype for a CPU they do not run on."""

    amx_bf16: bool
    avx512_bf16: bool
    source: str = "unknown"
    onednn_capped: bool = False  # oneDNN held below the CPU's bf16 instructions

    @property
    def bf16_instructions(self) -> bool:
        """Whether the CPU has either (whatever oneDNN may use)."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def native_bf16_matmul(self) -> bool:
        return self.bf16_instructions and not self.onednn_capped

    @property
    def bf16_support(self) -> str:
        """What an operator reads in the engine's dtype log line."""
        if not self.bf16_instructions:
            return "no native bf16 matmul on this CPU"
        found = "AMX-BF16" if self.amx_bf16 else "AVX512-BF16"
        if self.onednn_capped:
            return f"{found} detected, but oneDNN is held below it (ONEDNN_MAX_CPU_ISA)"
        return f"{found} detected"


def features_from_cpuinfo(text: str) -> CpuFeatures:
    """Features from /proc/cpuinfo's text: the first `flags` line (every core has the same)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return CpuFeatures("amx_bf16" in flags, "avx512_bf16" in flags, str(CPUINFO))
    return CpuFeatures(False, False)


@functools.cache
def detect_cpu_features() -> CpuFeatures:
    """This CPU's features, detected on the first call and cached for the process."""
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if amx is not None and avx512_bf16 is not None:
        features = CpuFeatures(bool(amx()), bool(avx512_bf16()), "torch")
    else:
        try:
            features = features_from_cpuinfo(CPUINFO.read_text())
        except OSError:
            features = CpuFeatures(False, False)
    if features.bf16_instructions and onednn_packs_bf16() is False:
        return dataclasses.replace(features, onednn_capped=True)
    return features


def onednn_packs_bf16() -> bool | None:
    """Whether oneDNN, as capped (ONEDNN_MAX_CPU_ISA), can pack and multiply bf16 weights
    here: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, emulating where the CPU has no bf16
    instructions. None where this torch cannot say."""
    import torch

    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return None if supported is None else bool(supported())


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one). The
    launcher, which imports nothing of the engine, keeps its own copy (commands/node_threads.py)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
