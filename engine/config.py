"""Engine configuration: one dataclass, checked once, passed down.

`EngineConfig` holds what the operator chooses; `ModelConfig` (model_config.py) holds what the
model folder dictates. Nothing reads configuration from the environment after construction.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.kv.admission import ADMISSION_POLICIES
from pdserve.engine.sched.preemption import PREEMPTION_MODES
from pdserve.wire.config_flags import gib_to_bytes, option

if TYPE_CHECKING:
    import torch

    from pdserve.engine.cpu.cpu_features import CpuFeatures
    from pdserve.engine.cpu.dtype_choice import DtypeChoice

# dtype names -> torch's; torch is imported only when a dtype is resolved, so the parsers
# generated from EngineConfig (wire/config_flags.py) load without it.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# KV cache dtypes besides "auto" (the model's dtype) -> torch's; "fp8" is vLLM's alias.
_KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn"}
KV_CACHE_DTYPE_CHOICES = ("auto", *_KV_CACHE_DTYPES)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("int8", "int4")  # engine/layers/int8_weight.py, int4_weight.py
DEFAULT_SWAP_SPACE = 4 << 30


def default_attention_backend(device: torch.device) -> str:
    """What `attention_backend="auto"` means on `device`: the Triton kernels on CUDA, the torch
    reference (gather by block table, then SDPA) on the CPU."""
    return "triton" if device.type == "cuda" else "torch"


@dataclass
class EngineConfig:
    """Operator-chosen settings of one engine (one node, one device). Each field's `option`
    metadata gives its flag and help; every parser is generated from them
    (wire/config_flags.py).

    model: a model folder (config.json + *.safetensors + tokenizer files); None means the
        default model, downloaded on first use.
    tokenizer: a folder whose tokenizer files replace the model folder's (grammars are built
        and text is decoded with it); None: the model folder's.
    dtype: "auto" (on CUDA the config's 16-bit dtype or bf16; on the CPU bf16 where it has
        AMX-BF16 or AVX512-BF16, else fp32: engine/cpu/dtype_choice.py) or a dtype name.
    kv_cache_dtype: "auto" (the KV cache holds the model's dtype) or "fp8_e4m3" ("fp8" is
        vLLM's alias, stored as "fp8_e4m3"): one byte per element, stored as x / scale and read
        as x * scale with per-layer scales (engine/kv/kv_scales.py), so a block is half a 16-bit
        one and the same memory holds twice the blocks.
    quantization: None (weights in `dtype`), "int8" or "int4": every linear's weight quantized
        when it loads. int8: one scale per output row, multiplied by CPU kernels in fp32
        (engine/layers/int8_weight.py); a quarter of fp32's weight bytes for decode steps.
        int4: an fp16 scale and minimum per output row and 32 inputs, multiplied in integers
        against inputs rounded to int8 per token and 32 (engine/layers/int4_weight.py); 5 bits a
        weight. Each with the accuracy bound tests/engine/test_quantized_weights.py states.
        CPU only.
    load_format: "auto" (weights from the folder's *.safetensors) or "dummy" (random weights
        drawn from `seed`; the folder needs only config.json, and without tokenizer files the
        engine takes token ids only) (engine/runner/loader.py).
    kv_cache_memory: bytes for the KV cache; on CUDA, None means this process's share of the
        device (engine/runner/memory_budget.py) minus what the process already holds.
    gpu_memory_utilization: the fraction of the device's memory that the `processes_on_device`
        node processes placed on it may hold together (weights, activations, KV cache); each
        gets an equal share. One process with a smaller fraction is an explicit share.
    num_kv_blocks: an exact block count, overriding the memory budget (tests, capacity drills).
    tensor_parallel_size: ranks that split the model (engine/distributed/): each holds its
        shard of every layer and a KV cache of its KV heads with the same block ids; memory
        options (`kv_cache_memory`, `num_kv_blocks`, `swap_space`) are per rank; on the CPU
        the node's `num_threads` (default: every usable core) are split between them. No CUDA
        graphs under it.
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
        speeds), "recompute" or "swap" (engine.sched.preemption); `swap_space` bytes of host memory
        hold swapped-out KV (allocated on first use; 0 disables swapping).
    admission: "optimistic", "worst-case" or "predicted" (engine.kv.admission), with
        `admission_quantile` of observed output lengths for "predicted".
    priority_aging_s: seconds of waiting worth one priority level (engine.sched.sequence_queue);
        0 makes priorities strict.
    """

    model: str | None = option(
        None, flag="--model", launcher_sets=True,
        help="model folder (default: the default model)",
    )
    tokenizer: str | None = option(
        None, flag="--tokenizer", launcher_sets=True, metavar="PATH",
        help="a folder whose tokenizer files replace the model folder's (default: the model's)",
    )
    dtype: str = option(
        "auto", flag="--dtype", choices=("auto", *_DTYPES),
        help="weights, activations and KV cache (default auto: on CUDA the config's 16-bit "
        "dtype, else bfloat16; on the CPU bfloat16 with AMX-BF16 or AVX512-BF16, else float32)",
    )
    kv_cache_dtype: str = option(
        "auto", flag="--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES,
        help="KV cache storage (default auto: the model's dtype); fp8_e4m3 (alias fp8) keeps "
        "one byte per element with per-layer scales from the checkpoint (else 1.0)",
    )
    quantization: str | None = option(
        None, flag="--quantization", aliases=("-q",), choices=QUANTIZATIONS,
        help="int8: weight-only int8 linears (one scale per output row); int4: 4-bit linears "
        "(a scale and minimum per row and 32 inputs, inputs rounded to int8); both quantized "
        "at load, CPU only; default: none, weights in --dtype",
    )
    load_format: str = option(
        "auto", flag="--load-format", choices=LOAD_FORMATS,
        help="auto (default: the folder's *.safetensors) or dummy (random weights from "
        "config.json, for a model's shapes without its weights)",
    )
    device: str = option(
        "auto", flag="--device", launcher_sets=True,
        help="auto (default: the first visible GPU, else the CPU), cpu or cuda:N",
    )
    block_size: int = option(16, flag="--block-size", help="tokens per KV block (a power of 2)")
    max_num_batched_tokens: int = option(
        2048, flag="--max-num-batched-tokens", help="token budget per step"
    )
    max_num_seqs: int = option(256, flag="--max-num-seqs", help="sequences in one step")
    max_model_len: int | None = option(
        None, flag="--max-model-len",
        help="longest prompt + completion (default: the model's max_position_embeddings)",
    )
    kv_cache_memory: int | None = option(
        None, flag="--kv-cache-memory", aliases=("--kv-cache-memory-bytes",), metavar="BYTES",
        help="KV cache size (default: 1 GiB on the CPU; on CUDA the rest of the share)",
    )
    num_kv_blocks: int | None = option(
        None, flag="--num-kv-blocks", aliases=("--num-gpu-blocks-override",), metavar="N",
        help="an exact KV block count (default: from the memory budget)",
    )
    gpu_memory_utilization: float = option(
        0.9, flag="--gpu-memory-utilization", metavar="FRACTION",
        help="fraction of each GPU's memory that the node processes on it hold together, in "
        "equal shares",
    )
    processes_on_device: int = option(
        1, flag="--processes-on-device", metavar="N", launcher_sets=True,
        help="node processes sharing this node's GPU; `pdserve serve` counts them",
    )
    tensor_parallel_size: int = option(
        1, flag="--tensor-parallel-size", aliases=("-tp",), metavar="N",
        help="ranks, one process each (one GPU each on CUDA), that split every layer and the "
        "KV heads; rank 0 schedules and samples (engine/distributed/)",
    )
    attention_backend: str = option(
        "auto", flag="--attention-backend",
        help="auto (default: triton on CUDA, torch on the CPU), torch or triton",
    )
    cuda_graphs: bool | None = option(
        None, flag="--enforce-eager", switch=True, to_field=operator.not_,
        help="no CUDA graphs (default: decode steps replay them on CUDA with triton attention)",
    )
    enable_prefix_caching: bool = option(
        True, flag="--enable-prefix-caching",
        help="reuse the KV of prompt prefixes seen before",
    )
    prefix_cache_min_blocks: int = option(
        2, flag="--prefix-cache-min-blocks",
        help="shortest run of full KV blocks the prefix cache keeps",
    )
    num_threads: int | None = option(
        None, flag="--num-threads", launcher_sets=True, help="torch CPU threads"
    )
    seed: int = option(
        0, flag="--seed",
        help="seeds sampling of requests without a seed, and dummy weights",
    )
    preemption_mode: str = option(
        "auto", flag="--preemption-mode", choices=PREEMPTION_MODES,
        help="cure for preempted requests (default auto: the cheaper by measured cost)",
    )
    swap_space: int = option(
        DEFAULT_SWAP_SPACE, flag="--swap-space", type=float, metavar="GIB",
        to_field=gib_to_bytes,
        help="host memory per node for swapped-out KV, in GiB (default 4; 0: no swapping)",
    )
    admission: str = option(
        "optimistic", flag="--admission", choices=ADMISSION_POLICIES,
        help="KV reserved at admission (default optimistic: the next chunk only)",
    )
    admission_quantile: float = option(
        0.9, flag="--admission-quantile",
        help="quantile of observed output lengths that predicted admission reserves",
    )
    priority_aging_s: float = option(
        10.0, flag="--priority-aging-seconds",
        help="seconds of waiting worth one priority level (0: strict priorities)",
    )

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
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
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
        from pdserve.engine.attention import ATTENTION_BACKENDS

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
                self.resolve_device().type == "cuda"
                and self.attention_backend == "triton"
                and self.tensor_parallel_size == 1
            )
        if self.cuda_graphs and self.tensor_parallel_size > 1:
            raise ValueError(
                f"cuda_graphs are not supported with tensor_parallel_size "
                f"{self.tensor_parallel_size} (the graphs would capture its collectives); "
                "pass --enforce-eager"
            )
        if self.cuda_graphs and self.attention_backend != "triton":
            raise ValueError(
                f"cuda_graphs needs attention_backend 'triton', got {self.attention_backend!r}"
            )

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element dtype for a model running in `model_dtype`."""
        import torch

        if self.kv_cache_dtype == "auto":
            return model_dtype
        return getattr(torch, _KV_CACHE_DTYPES[self.kv_cache_dtype])

    def resolve_dtype(
        self,
        device: torch.device,
        config_dtype: torch.dtype | None,
        cpu: CpuFeatures | None = None,
    ) -> DtypeChoice:
        """The dtype to run in on `device`, and why (engine/cpu/dtype_choice.py); `cpu` None
        detects this machine's features, a test passes others."""
        import torch

        from pdserve.engine.cpu.dtype_choice import choose_dtype

        requested = None if self.dtype == "auto" else getattr(torch, _DTYPES[self.dtype])
        return choose_dtype(requested, device, config_dtype, cpu, self.quantization)
