"""The dtype an engine runs in (weights, activations, the KV cache), and why.

`EngineConfig.resolve_dtype` calls `choose_dtype` once, when the model runner starts, and the
runner logs the choice once ("dtype bfloat16: AMX-BF16 detected"). An explicit `--dtype` is
taken as given. `--dtype auto` means:
  - CUDA: the model config's 16-bit dtype, else bf16;
  - CPU with native bf16 matrix multiplies (AMX-BF16 or AVX512-BF16, engine/cpu/cpu_features.py):
    bf16, whatever the config says (fp16 has no fast path on these CPUs);
  - any other CPU: fp32;
  - the CPU with quantized weights (`--quantization int8` or `int4`): fp32 whatever the CPU,
    since their kernels take fp32 inputs and the compiled decode step runs on fp32 activations
    (bf16 activations would only add conversions around every linear).
On the CPU, bf16 tokens are not always transformers' fp32 tokens (rounding flips near-ties);
tests that compare tokens with fp32 pass `dtype="float32"` (tests/engine/test_bf16_cpu.py states
how far bf16 strays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.cpu.cpu_features import CpuFeatures, detect_cpu_features


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}: {self.reason}"


def choose_dtype(
    requested: torch.dtype | None,
    device: torch.device,
    config_dtype: torch.dtype | None,
    cpu: CpuFeatures | None = None,
    quantization: str | None = None,
) -> DtypeChoice:
    """`requested` None is "auto". `cpu` None detects this machine's features (on a CPU
    device only); a test passes the features of the CPU it pretends to run on."""
    if requested is not None:
        return DtypeChoice(requested, "requested")
    if device.type != "cpu":
        if config_dtype in (torch.float16, torch.bfloat16):
            return DtypeChoice(config_dtype, f"auto on {device.type}: the model config's dtype")
        return DtypeChoice(torch.bfloat16, f"auto on {device.type}")
    if quantization is not None:
        return DtypeChoice(torch.float32, f"auto on the CPU with {quantization} weights")
    cpu = cpu or detect_cpu_features()
    dtype = torch.bfloat16 if cpu.native_bf16_matmul else torch.float32
    return DtypeChoice(dtype, f"auto on the CPU, {cpu.bf16_support}")
