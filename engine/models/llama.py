"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2, Qwen3) over a flat batch.

One forward serves prefill chunks, decodes and mixed steps: the batch is a flat token stream with
no padding, and attention reads and writes the paged KV cache through the attention backend.
Differences between the family members are config flags: qkv bias (Qwen2), q/k RMSNorm over
the head dimension before rope (Qwen3), tied embeddings, sliding window (Mistral).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.layers.rms_norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig

# HF weight name suffix -> (fused parameter name, shard index)
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class FusedLinear(nn.Linear):
    """A linear layer whose output rows are several HF projections stacked (q|k|v, gate|up)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]

    def load_shard(self, shard: int, param_name: str, tensor: torch.Tensor) -> None:
        target = self.weight if param_name == "weight" else self.bias
        start, end = self.shard_offsets[shard], self.shard_offsets[shard + 1]
        if tensor.shape[0] != end - start:
            raise ValueError(f"shard {shard} has {tensor.shape[0]} rows, expected {end - start}")
        target.data[start:end].copy_(tensor)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias
        )
        o_bias = config.attention_bias and config.hf_config.model_type != "qwen2"
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.split_sizes = [q_size, kv_size, kv_size]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        metadata: object,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        out = backend.forward(self.layer_index, q, k, v.contiguous(), metadata)
        return self.o_proj(out.view(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = FusedLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, backend, metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, backend, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: AttentionBackend,
        metadata: object,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the flat batch's selected token positions."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, backend, metadata)
        hidden = self.norm(hidden.index_select(0, logits_indices))
        return F.linear(hidden, self.lm_head_weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (partly fused) parameters; every one must arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused_loaded: dict[str, set[int]] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module_path, _, param_name = name.rpartition(".")
            fused = next((f for f in _FUSED_SHARDS if module_path.endswith(f)), None)
            if fused is not None:
                fused_name, shard = _FUSED_SHARDS[fused]
                module_path = module_path[: -len(fused)] + fused_name
                self.get_submodule(module_path).load_shard(shard, param_name, tensor)
                fused_loaded.setdefault(f"{module_path}.{param_name}", set()).add(shard)
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture}")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
        for name, shards in fused_loaded.items():
            fused_module = self.get_submodule(name.rpartition(".")[0])
            if len(shards) == len(fused_module.shard_offsets) - 1:
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
