"""What `dtype="auto"` runs in, decided from features a test injects (not this machine's): bf16
on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, fp32 on other CPUs; an explicit dtype wins
everywhere; fp32 on every CPU with int8 weights. The CPU's features come from torch or, without
its helpers, /proc/cpuinfo."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu.cpu_features import CpuFeatures, detect_cpu_features, features_from_cpuinfo

CPU = torch.device("cpu")
AMX = CpuFeatures(amx_bf16=True, avx512_bf16=True)
AVX512_BF16 = CpuFeatures(amx_bf16=False, avx512_bf16=True)
NO_BF16 = CpuFeatures(amx_bf16=False, avx512_bf16=False)
AMX_UNDER_AVX2_ONEDNN = CpuFeatures(amx_bf16=True, avx512_bf16=True, onednn_capped=True)


@pytest.mark.parametrize(
    ("cpu", "dtype", "reason"),
    [
        (AMX, torch.bfloat16, "AMX-BF16 detected"),
        (AVX512_BF16, torch.bfloat16, "AVX512-BF16 detected"),
        (NO_BF16, torch.float32, "no native bf16 matmul on this CPU"),
        (
            AMX_UNDER_AVX2_ONEDNN,
            torch.float32,
            "AMX-BF16 detected, but oneDNN is held below it (ONEDNN_MAX_CPU_ISA)",
        ),
    ],
    ids=["amx", "avx512-bf16", "zen3-like", "amx-onednn-held-to-avx2"],
)
@pytest.mark.parametrize("config_dtype", [None, torch.float32, torch.float16, torch.bfloat16])
def test_auto_on_the_cpu_is_bf16_only_with_native_bf16_matmuls(cpu, dtype, reason, config_dtype):
    choice = EngineConfig().resolve_dtype(CPU, config_dtype, cpu)
    assert choice.dtype == dtype
    assert str(choice).startswith(str(dtype).removeprefix("torch.") + ":")
    assert str(choice).endswith(reason)


@pytest.mark.parametrize(
    ("config_dtype", "dtype"),
    [(None, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
)
@pytest.mark.parametrize("cpu", [AMX, NO_BF16], ids=["amx-host", "plain-host"])
def test_auto_on_cuda_keeps_the_configs_16_bit_dtype_whatever_the_host_cpu(
    config_dtype, dtype, cpu
):
    choice = EngineConfig(device="cpu").resolve_dtype(torch.device("cuda:0"), config_dtype, cpu)
    assert choice.dtype == dtype


@pytest.mark.parametrize("cpu", [AMX, AVX512_BF16, NO_BF16], ids=["amx", "avx512-bf16", "zen3"])
def test_auto_with_int8_weights_on_the_cpu_is_fp32_and_an_explicit_dtype_still_wins(cpu):
    choice = EngineConfig(quantization="int8").resolve_dtype(CPU, torch.bfloat16, cpu)
    assert choice.dtype == torch.float32
    assert str(choice) == "float32: auto on the CPU with int8 weights"
    explicit = EngineConfig(quantization="int8", dtype="bfloat16").resolve_dtype(CPU, None, cpu)
    assert explicit.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
     ("float16", torch.float16)],
)
@pytest.mark.parametrize("cpu", [AMX, NO_BF16], ids=["amx", "zen3-like"])
def test_an_explicit_dtype_wins_over_what_the_cpu_has(name, dtype, cpu):
    choice = EngineConfig(dtype=name).resolve_dtype(CPU, torch.bfloat16, cpu)
    assert choice.dtype == dtype and choice.reason == "requested"


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
flags\t\t: fpu sse2 avx2 fma {extra}
processor\t: 1
flags\t\t: fpu sse2 avx2 fma {extra}
"""


@pytest.mark.parametrize(
    ("vendor", "extra", "amx", "avx512_bf16"),
    [
        ("GenuineIntel", "avx512f avx512_bf16 amx_tile amx_bf16 amx_int8", True, True),
        ("AuthenticAMD", "avx512f avx512_bf16", False, True),
        ("AuthenticAMD", "sha_ni", False, False),
    ],
    ids=["sapphire-rapids", "zen4", "zen3"],
)
def test_cpuinfo_flags_name_the_bf16_instructions(vendor, extra, amx, avx512_bf16):
    features = features_from_cpuinfo(CPUINFO.format(vendor=vendor, extra=extra))
    assert (features.amx_bf16, features.avx512_bf16) == (amx, avx512_bf16)
    assert features.source == "/proc/cpuinfo"


def test_cpuinfo_without_a_flags_line_means_no_bf16():
    assert not features_from_cpuinfo("Processor\t: AArch64\nFeatures\t: fp asimd\n").amx_bf16
    assert not features_from_cpuinfo("").native_bf16_matmul


def test_detection_is_done_once_per_process():
    assert detect_cpu_features() is detect_cpu_features()


def test_the_engine_logs_its_dtype_and_why_once(tiny_llama_dir, caplog):
    from pdserve.engine import LLM

    expected = torch.bfloat16 if detect_cpu_features().native_bf16_matmul else torch.float32
    with caplog.at_level(logging.INFO, logger="pdserve.engine.runner.model_runner"):
        llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=8)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
    name = str(expected).removeprefix("torch.")
    assert lines == [f"dtype {name}: auto on the CPU, {detect_cpu_features().bf16_support}"]
    assert llm.engine.runner.dtype == expected
    assert llm.engine.runner.kv_cache.spec.dtype == expected


def test_a_onednn_held_below_the_cpus_bf16_instructions_makes_auto_fp32_and_packs_fp32(
    tiny_llama_dir,
):
    """In a child process with ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN then refuses to pack bf16
    weights): auto is fp32 whatever the CPU, and the engine loads and answers."""
    import os
    import subprocess
    import sys

    script = (
        "from pdserve.engine import LLM, SamplingParams\n"
        "from pdserve.engine.cpu.cpu_features import detect_cpu_features\n"
        f"llm = LLM({str(tiny_llama_dir)!r}, device='cpu', num_kv_blocks=8)\n"
        "out = llm.generate([[5, 6, 7]], [SamplingParams(max_tokens=2, temperature=0.0)])\n"
        "print(llm.engine.runner.dtype, detect_cpu_features().native_bf16_matmul,"
        " len(out[0].token_ids))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    child = subprocess.run(
        [sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[-3:] == ["torch.float32", "False", "2"], child.stdout
