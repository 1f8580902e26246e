"""Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2, Qwen3) over a flat batch.

One forward serves prefill chunks, decodes and mixed steps: the batch is a flat token stream with
no padding, and attention reads and writes the paged KV cache through the attention backend.
Differences between the family members are config flags: qkv bias (Qwen2), q/k RMSNorm over
the head dimension before rope (Qwen3), tied embeddings, sliding window (Mistral).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.layers.linear import FusedLinear, Linear
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


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.qkv_bias, dtype=dtype
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype)
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
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = FusedLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        size = self.intermediate_size
        return self.down_proj(F.silu(gate_up[:, :size], inplace=True).mul_(gate_up[:, size:]))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden, cos, sin, backend, metadata) -> torch.Tensor:
        """Adds both residuals into `hidden` in place (the model's own activation buffer)."""
        hidden.add_(self.self_attn(self.input_layernorm(hidden), cos, sin, backend, metadata))
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden)))


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype | None = None
    ) -> None:
        """Every parameter is created in `dtype` (None: torch's default) on the current device,
        so a 16-bit model never exists in fp32; the rope tables stay fp32."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, max_positions)
        # Tied or not, the head keeps its own weight, packed for its kernel (layers/linear.py).
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

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
        return self.lm_head(hidden)

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step streams: every matrix and norm, not the embedding
        table (a step gathers only a few of its rows)."""
        linear = sum(m.weight_bytes for m in self.modules() if isinstance(m, Linear))
        norms = sum(
            p.numel() * p.element_size() for m in self.modules() if isinstance(m, RMSNorm)
            for p in m.parameters()
        )
        return linear + norms

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (fused, transposed) parameters; all must arrive."""
        expected = {name for name, _ in self.named_parameters()}
        loaded: set[str] = set()
        shards_loaded: dict[str, set[int]] = defaultdict(set)
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            module_path, _, param_name = hf_name.removeprefix("model.").rpartition(".")
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
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
