"""`pdserve plan`: how much KV cache a model needs and how many sequences fit in a memory budget.

KV bytes per token = 2 (key and value) x layers x KV heads x head dim x KV element bytes: the
weights' dtype with `--kv-cache-dtype auto`, 1 with fp8_e4m3 (EngineConfig.kv_cache_dtype), so
an fp8 cache holds twice the tokens of a bf16 one and four times an fp32 one in the same budget.
A sequence of n tokens holds ceil(n / block_size) blocks of block_size tokens each (paged KV
wastes less than one block per sequence). Concurrency = (memory - weights - reserve) // bytes
per sequence. Weights are counted from the shapes (embedding, attention, MLP, norms, an untied
LM head), in `dtype`.

With `--tensor-parallel-size N` every number is one device's (`--memory` is each device's):
the weights of one rank's shard and the KV of its KV heads, as engine/distributed/layout.py
splits them (heads, MLP columns and vocabulary rows / N; KV heads / N, or one replicated KV head
per rank when the model has fewer than N). Every rank holds the same blocks, so the smallest
budget is the engine's: concurrency is one device's budget over one device's KV per sequence.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.distributed.layout import ShardLayout

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
KV_CACHE_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8": 1}  # besides "auto": the weights' dtype


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False

    @property
    def num_parameters(self) -> int:
        return self.rank_parameters(self.layout(1))

    def layout(self, tensor_parallel_size: int) -> ShardLayout:
        """Rank 0's shard (every rank's is as large); ValueError for sizes that do not split."""
        from pdserve.engine.distributed.layout import ShardLayout

        return ShardLayout.for_rank(
            0, tensor_parallel_size, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate_size, self.vocab_size,
        )

    def rank_parameters(self, layout: ShardLayout) -> int:
        """Parameters one rank holds: its shard of every matrix, whole norms and row-parallel
        biases (there are none here: only q, k and v carry a bias)."""
        h, q, kv = (
            self.hidden_size,
            layout.num_heads * self.head_dim,
            layout.num_kv_heads * self.head_dim,
        )
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        per_layer = attention + 3 * h * layout.intermediate_size + 2 * h
        embeddings = layout.vocab_rows * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h


KNOWN_MODELS = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
        ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, False),
        ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, qkv_bias=True),
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True),
    )
}


def shape_from_folder(path: Path) -> ModelShape:
    config = json.loads((path / "config.json").read_text())
    heads = config["num_attention_heads"]
    return ModelShape(
        name=path.name,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
    )


def resolve_shape(model: str) -> ModelShape:
    """A known name (case-insensitive) or a model folder with a config.json."""
    known = KNOWN_MODELS.get(model.lower())
    if known is not None:
        return known
    path = Path(model)
    if (path / "config.json").is_file():
        return shape_from_folder(path)
    raise ValueError(
        f"{model!r} is neither a model folder nor a known model; known: {', '.join(KNOWN_MODELS)}"
    )


@dataclass(frozen=True)
class SequencePlan:
    tokens: int
    kv_bytes: int
    max_concurrency: int


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    tensor_parallel_size: int
    kv_bytes_per_token: int  # per device, as every number below
    weight_bytes: int
    memory_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    sequences: list[SequencePlan]


def plan_capacity(
    shape: ModelShape,
    dtype: str,
    memory_bytes: int,
    reserve_fraction: float,
    seq_lens: list[int],
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> CapacityPlan:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPE_BYTES)}, got "
            f"{kv_cache_dtype!r}"
        )
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"the reserve must be a fraction in [0, 1), got {reserve_fraction}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    layout = shape.layout(tensor_parallel_size)
    element = DTYPE_BYTES[dtype]
    kv_element = KV_CACHE_DTYPE_BYTES.get(kv_cache_dtype, element)
    kv_cache_dtype = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    per_token = 2 * shape.num_layers * layout.num_kv_heads * shape.head_dim * kv_element
    weights = shape.rank_parameters(layout) * element
    reserve = int(memory_bytes * reserve_fraction)
    budget = max(0, memory_bytes - weights - reserve)
    sequences = []
    for tokens in seq_lens:
        kv_bytes = -(-tokens // block_size) * block_size * per_token
        sequences.append(SequencePlan(tokens, kv_bytes, budget // kv_bytes if kv_bytes else 0))
    return CapacityPlan(
        shape.name, dtype, kv_cache_dtype, block_size, tensor_parallel_size, per_token, weights,
        memory_bytes, reserve, budget, sequences,
    )


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes} B"


def render_table(plan: CapacityPlan) -> str:
    devices = plan.tensor_parallel_size
    lines = [
        (
            f"model {plan.model}, {plan.dtype}, KV cache {plan.kv_cache_dtype}, "
            f"block size {plan.block_size}"
            + (f", {devices} tensor-parallel ranks (per device below)" if devices > 1 else "")
        ),
        f"KV per token        {_size(plan.kv_bytes_per_token)} ({plan.kv_bytes_per_token:,} bytes)",
        f"weights             {_size(plan.weight_bytes)}",
        f"memory              {_size(plan.memory_bytes)} (reserve {_size(plan.reserve_bytes)})",
        f"KV budget           {_size(plan.kv_budget_bytes)}",
        "",
        f"{'tokens':>10}  {'KV per sequence':>16}  {'max sequences':>13}",
    ]
    for seq in plan.sequences:
        lines.append(f"{seq.tokens:>10,}  {_size(seq.kv_bytes):>16}  {seq.max_concurrency:>13,}")
    return "\n".join(lines)


def render_json(plan: CapacityPlan) -> str:
    return json.dumps(asdict(plan), indent=2)


def parse_bytes(text: str) -> int:
    """`80GiB`, `512MiB`, `16GB`, or a plain byte count."""
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
    }
    lowered = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda item: -len(item[0])):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    return int(lowered)
