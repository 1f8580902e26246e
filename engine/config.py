"""Engine configuration: one dataclass, checked once, passed down.

`EngineConfig` holds what the operator chooses; `ModelConfig` (model_config.py) holds what the
model folder dictates. Nothing reads configuration from the environment after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.admission import ADMISSION_POLICIES
from engine.preemption import PREEMPTION_MODES

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
LOAD_FORMATS = ("auto", "dummy")
DEFAULT_SWAP_SPACE = 4 << 30


def default_attention_backend(device: torch.device) -> str:
    """What `attention_backend="auto"` means on `device`: the Triton kernels on CUDA, the torch
    reference (gather by block table, then SDPA) on the CPU."""
    return "triton" if device.type == "cuda" else "torch"


@dataclass
class EngineConfig:
    """Operator-chosen settings of one engine (one node, one device).

    model: a model folder (config.json + *.safetensors + tokenizer files); None means the
        default model, downloaded on first use.
    dtype: "auto" (fp32 on CPU; the config's 16-bit dtype or bf16 on CUDA) or a dtype name.
    load_format: "auto" (weights from the folder's *.safetensors) or "dummy" (random weights
        drawn from `seed`; the folder needs only config.json, and without tokenizer files the
        engine takes token ids only) (engine/loader.py).
    kv_cache_memory: bytes for the KV cache; on CUDA, None means this process's share of the
        device (engine/memory_budget.py) minus what the process already holds.
    gpu_memory_utilization: the fraction of the device's memory that the `processes_on_device`
        node processes placed on it may hold together (weights, activations, KV cache); each
        gets an equal share. One process with a smaller fraction is an explicit share.
    num_kv_blocks: an exact block count, overriding the memory budget (tests, capacity drills).
    max_model_len: None means the model's `max_position_embeddings`.
    attention_backend: "auto" (triton on a CUDA device, torch on the CPU), "torch" or
        "triton"; construction resolves "auto", so the field always names a backend.
    cuda_graphs: replay captured CUDA graphs for pure-decode steps (the triton backend only;
        ignored on the CPU). None means on exactly when the device is CUDA and the backend
        triton; construction resolves it. The CLIs' `--enforce-eager` sets it False.
    enable_prefix_caching: keep full KV blocks after their requests and reuse them for prompts
        that start with the same tokens; `prefix_cache_min_blocks` is the shortest run of full
        blocks worth keeping.
    preemption_mode: "auto" (per sequence, the cheaper of recompute and swap by measured
        speeds), "recompute" or "swap" (engine.preemption); `swap_space` bytes of host memory
        hold swapped-out KV (allocated on first use; 0 disables swapping).
    admission: "optimistic", "worst-case" or "predicted" (engine.admission), with
        `admission_quantile` of observed output lengths for "predicted".
    priority_aging_s: seconds of waiting worth one priority level (engine.sequence_queue);
        0 makes priorities strict.
    """

    model: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    processes_on_device: int = 1
    attention_backend: str = "auto"
    cuda_graphs: bool | None = None
    enable_prefix_caching: bool = True
    prefix_cache_min_blocks: int = 2
    num_threads: int | None = None
    seed: int = 0
    preemption_mode: str = "auto"
    swap_space: int = DEFAULT_SWAP_SPACE
    admission: str = "optimistic"
    admission_quantile: float = 0.9
    priority_aging_s: float = 10.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}"
            )
        if self.prefix_cache_min_blocks < 1:
            raise ValueError(
                f"prefix_cache_min_blocks must be >= 1, got {self.prefix_cache_min_blocks}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.processes_on_device < 1:
            raise ValueError(f"processes_on_device must be >= 1, got {self.processes_on_device}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}"
            )
        if not 0.0 < self.admission_quantile <= 1.0:
            raise ValueError(
                f"admission_quantile must be in (0, 1], got {self.admission_quantile}"
            )
        if self.priority_aging_s < 0:
            raise ValueError(f"priority_aging_s must be >= 0, got {self.priority_aging_s}")
        from engine.attention import ATTENTION_BACKENDS

        if self.attention_backend == "auto":
            self.attention_backend = default_attention_backend(self.resolve_device())
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.attention_backend!r} is unknown; valid: "
                f"{', '.join(sorted(ATTENTION_BACKENDS))}, or 'auto' (triton on CUDA, torch on "
                "the CPU)"
            )
        if self.cuda_graphs is None:
            self.cuda_graphs = (
                self.resolve_device().type == "cuda" and self.attention_backend == "triton"
            )
        if self.cuda_graphs and self.attention_backend != "triton":
            raise ValueError(
                f"cuda_graphs needs attention_backend 'triton', got {self.attention_backend!r}"
            )

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        if config_dtype in (torch.float16, torch.bfloat16):
            return config_dtype
        return torch.bfloat16
