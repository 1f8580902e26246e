"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2, Qwen3) over a flat batch.

One forward serves prefill chunks, decodes and mixed steps: the batch is a flat token stream with
no padding, and attention reads and writes the paged KV cache through the attention backend.
Differences between the family members are config flags: qkv bias (Qwen2), q/k RMSNorm over
the head dimension before rope (Qwen3), tied embeddings, sliding window (Mistral).

Under tensor parallelism (`layout` of more than one rank) each rank builds its shard of every
layer (engine/distributed/layout.py) and loads its part of each HF tensor (`_SPLITS`); the
row-parallel o/down projections and the vocabulary-parallel embedding all-reduce, and the head's
logits are gathered to rank 0, the only rank whose forward returns them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.cpu.huge_pages import zeroed_cpu_bytes
from pdserve.engine.distributed.group import RankGroup
from pdserve.engine.distributed.layout import ShardLayout
from pdserve.engine.layers.linear import FusedLinear, Linear
from pdserve.engine.layers.parallel import RowParallelLinear, VocabParallelEmbedding, take_shard
from pdserve.engine.layers.rms_norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.model_config import ModelConfig

# HF weight name suffix -> (fused parameter name, shard index)
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# HF module suffix -> how a tensor-parallel rank takes its part (layers/parallel.py take_shard)
_SPLITS = {
    "self_attn.q_proj": ("rows", "q"),
    "self_attn.k_proj": ("rows", "kv"),
    "self_attn.v_proj": ("rows", "kv"),
    "mlp.gate_proj": ("rows", "mlp"),
    "mlp.up_proj": ("rows", "mlp"),
    "self_attn.o_proj": ("columns", "q"),
    "mlp.down_proj": ("columns", "mlp"),
    "embed_tokens": ("rows", "vocab"),
    "lm_head": ("rows", "vocab"),
}


def whole_model_layout(config: ModelConfig) -> ShardLayout:
    """The layout of one rank holding everything."""
    return shard_layout(config, 0, 1)


def shard_layout(config: ModelConfig, rank: int, size: int) -> ShardLayout:
    """Rank `rank`'s shard of `size`; ValueError naming the numbers when they do not divide."""
    return ShardLayout.for_rank(
        rank, size, config.num_heads, config.num_kv_heads, config.head_dim,
        config.intermediate_size, config.vocab_size,
    )


def _row_linear(
    in_features: int, out_features: int, bias: bool, group: RankGroup, dtype: torch.dtype | None
) -> Linear:
    if group.size == 1:
        return Linear(in_features, out_features, bias, dtype=dtype)
    return RowParallelLinear(in_features, out_features, bias, group, dtype=dtype)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype | None,
        layout: ShardLayout,
        group: RankGroup,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.qkv_bias, dtype=dtype
        )
        self.o_proj = _row_linear(q_size, config.hidden_size, config.o_proj_bias, group, dtype)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype) if config.qk_norm else None
        self.num_qk_heads = self.num_heads + self.num_kv_heads

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        metadata: object,
    ) -> torch.Tensor:
        """Rope is written over q and k inside the fused projection's output, so q, k and v
        are views of that one tensor (a Qwen3 layer's normed q and k are its only copy)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        qk = qkv[:, : self.num_qk_heads]
        if self.q_norm is not None:
            heads = self.num_heads
            normed = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
            RotaryEmbedding.apply(normed, cos, sin, out=qk)
        else:
            RotaryEmbedding.apply(qk, cos, sin, out=qk)
        q = qkv[:, : self.num_heads]
        k = qkv[:, self.num_heads : self.num_qk_heads]
        v = qkv[:, self.num_qk_heads :]
        out = backend.forward(self.layer_index, q, k, v, metadata)
        return self.o_proj(out.view(num_tokens, -1))


class MLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | None,
        layout: ShardLayout,
        group: RankGroup,
    ) -> None:
        super().__init__()
        self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = FusedLinear(
            config.hidden_size, [self.intermediate_size] * 2, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = _row_linear(
            self.intermediate_size, config.hidden_size, config.mlp_bias, group, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        size = self.intermediate_size
        return self.down_proj(F.silu(gate_up[:, :size], inplace=True).mul_(gate_up[:, size:]))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype | None,
        layout: ShardLayout,
        group: RankGroup,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, dtype, layout, group)
        self.mlp = MLP(config, dtype, layout, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden, cos, sin, backend, metadata) -> torch.Tensor:
        """Adds both residuals into `hidden` in place (the model's own activation buffer)."""
        hidden.add_(self.self_attn(self.input_layernorm(hidden), cos, sin, backend, metadata))
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden)))


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype | None = None,
        layout: ShardLayout | None = None,
        group: RankGroup | None = None,
        quantization: str | None = None,
    ) -> None:
        """Every parameter is created in `dtype` (None: torch's default) on the current device,
        so a 16-bit model never exists in fp32; the rope tables stay fp32. `layout` and
        `group`: this rank's shard and its tensor-parallel group (None: the whole model).
        `quantization` "int8" or "int4": every linear, the head included, is quantized once
        its weight is loaded (engine/layers/int8_weight.py, int4_weight.py); the embedding
        keeps `dtype`."""
        super().__init__()
        self.config = config
        self.quantization = quantization
        self.layout = layout = layout or whole_model_layout(config)
        self.group = group = group or RankGroup.single()
        if layout.size != group.size:
            raise ValueError(f"a layout of {layout.size} ranks for a group of {group.size}")
        if layout.size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        else:
            self.embed_tokens = VocabParallelEmbedding(layout, config.hidden_size, group, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, layout, group) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, max_positions)
        # Tied or not, the head keeps its own weight, packed for its kernel (layers/linear.py).
        self.lm_head = Linear(config.hidden_size, layout.vocab_rows, bias=False, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: AttentionBackend,
        metadata: object,
        layers_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the flat batch's selected token positions;
        under tensor parallelism on rank 0 only (the other ranks return None). `layers_done(n)`,
        where given, is called once the first n layers have written their KV (a prefill step
        streaming its blocks by layer group: engine/kv/layer_group_export.py)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, backend, metadata)
            if layers_done is not None:
                layers_done(index + 1)
        hidden = self.norm(hidden.index_select(0, logits_indices))
        logits = self.lm_head(hidden)
        if self.layout.size == 1:
            return logits
        logits = self.group.gather_last_dim(logits)
        if logits is None or logits.shape[-1] == self.config.vocab_size:
            return logits
        return logits[:, : self.config.vocab_size].contiguous()

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step streams: every matrix and norm, not the embedding
        table (a step gathers only a few of its rows)."""
        linear = sum(m.weight_bytes for m in self.modules() if isinstance(m, Linear))
        norms = sum(
            p.numel() * p.element_size() for m in self.modules() if isinstance(m, RMSNorm)
            for p in m.parameters()
        )
        return linear + norms

    def one_token_copy_bytes(self) -> int:
        """Bytes of the row-major weight copies kept for one-token steps (layers/linear.py's
        OneTokenWeight; 0 where its kernel does not run)."""
        return sum(
            m.one_token.num_bytes
            for m in self.modules() if isinstance(m, Linear) and m.one_token is not None
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (fused, transposed) parameters; all must arrive."""
        expected = {name for name, _ in self.named_parameters()}
        loaded: set[str] = set()
        shards_loaded: dict[str, set[int]] = defaultdict(set)
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            module_path, _, param_name = hf_name.removeprefix("model.").rpartition(".")
            if self.layout.size > 1:
                tensor = self._rank_part(module_path, param_name, tensor)
            shard = None
            for suffix, (fused_name, index) in _FUSED_SHARDS.items():
                if module_path.endswith(suffix):
                    module_path, shard = module_path[: -len(suffix)] + fused_name, index
            try:
                module = self.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"unexpected weight {hf_name!r}") from None
            if shard is not None:
                module.load_shard(shard, param_name, tensor)
            elif isinstance(module, Linear):
                module.load(param_name, tensor)
            else:
                param = getattr(module, param_name, None)
                if not isinstance(param, nn.Parameter) or param.shape != tensor.shape:
                    raise ValueError(f"unexpected weight {hf_name!r} {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            key = f"{module_path}.{param_name}"
            shards_loaded[key].add(shard or 0)
            if shard is None or len(shards_loaded[key]) == module.num_shards:
                loaded.add(key)
        if self.config.tie_word_embeddings and "embed_tokens.weight" in loaded:
            self.lm_head.load("weight", self.embed_tokens.weight.data)
            loaded.add("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
        self._pack_linears()

    def _rank_part(self, module_path: str, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole HF tensor (the whole tensor if it is replicated)."""
        for suffix, (split, kind) in _SPLITS.items():
            if module_path.endswith(suffix):
                return take_shard(tensor, self.layout, split, kind, param_name)
        return tensor

    def load_random_weights(self, generator: torch.Generator, std: float) -> None:
        """Dummy weights (load format "dummy"): every matrix and the embedding drawn from
        N(0, std) with `generator`, in parameter order; norms are ones and biases zeros, as
        built; a tied head gets a copy of the embedding."""
        tied = self.config.tie_word_embeddings
        for name, param in self.named_parameters():
            if param.dim() > 1 and not (tied and name == "lm_head.weight"):
                param.data.normal_(0.0, std, generator=generator)
        if tied:
            self.lm_head.load("weight", self.embed_tokens.weight.data)
        self._pack_linears()

    def _pack_linears(self) -> None:
        """Packs (or quantizes) every linear, then moves the one-token copies and the panels
        (if any) into one buffer on huge pages, each at a 64-byte boundary."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        for module in linears:
            module.pack(self.quantization)
        copies = [copy for module in linears for copy in module.huge_page_copies()]
        if not copies:
            return
        starts = [0]
        for copy in copies:
            starts.append(starts[-1] + -(-copy.num_bytes // 64) * 64)
        memory = zeroed_cpu_bytes(starts[-1])
        for copy, start in zip(copies, starts):
            copy.move_into(memory[start : start + copy.num_bytes])
