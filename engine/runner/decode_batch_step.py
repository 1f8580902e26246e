"""A step of decoding sequences only (one token each), on the CPU in bf16 or fp32, with the
small ops between the linears compiled (kernels/cpu_decode_glue.py): per layer three compiled
calls, the linears (engine/layers/linear.py: panels for fp32 and int8 weights, oneDNN's prepacked
matmuls for bf16) and the MLP's SiLU in torch, in place of about forty torch ops and their
Python.

`DecodeBatchStep.for_model` returns None unless every part it replaces has its compiled kernel:
a bf16 or fp32 Llama-family model on the CPU on one rank, no q/k norms (Qwen3 keeps the torch
path), a KV cache of the model's dtype read by the compiled decode attention (head dim a
multiple of 16). The runner takes
it for a step whose every sequence decodes one token, without prompt logprobs (a lone sequence
takes engine/runner/one_token_step.py where that runs); prefills and mixed steps go through the
torch forward, whose prefill stays bitwise transformers'. The embedding, the linears, the final
norm's weight and the LM head are the model's own modules and tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.kernels.cpu_gemv import bf16_words
from pdserve.kernels.numba_threads import run_parallel

COMPILED_DTYPES = (torch.bfloat16, torch.float32)


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 or fp32 tensor as the array the compiled kernels read and write
    (bf16 as its uint16 words), sharing its memory."""
    if tensor.dtype == torch.bfloat16:
        return bf16_words(tensor)
    return tensor.numpy()


def compiled_decode_fits(
    model: torch.nn.Module, kv_cache: KVCache, dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Whether the compiled decode kernels cover this model and cache: a Llama-family model in
    `dtype` on one rank without q/k norms, a CPU cache in `dtype` the decode attention kernel
    reads (numba installed, head dim a multiple of 16). engine/runner/one_token_step.py asks
    this too, and engine/runner/fp32_one_token_step.py with fp32."""
    if not isinstance(model, LlamaForCausalLM) or model.layout.size != 1:
        return False
    spec = kv_cache.spec
    if kv_cache.buffer.device.type != "cpu" or spec.dtype != dtype:
        return False
    if model.embed_tokens.weight.dtype != dtype or model.config.qk_norm:
        return False
    from pdserve.kernels.cpu_decode_attention import cpu_decode_attention_available
    from pdserve.kernels.cpu_decode_glue import numba

    return numba is not None and cpu_decode_attention_available(spec.dtype, spec.head_dim)


class DecodeBatchStep:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, scale: float, sliding_window: int | None
    ) -> None:
        from pdserve.kernels import cpu_decode_glue as glue
        from pdserve.kernels.cpu_attention_chunk import lane_order
        from pdserve.kernels.cpu_decode_attention import heads_per_call

        self.model = model
        self._glue = glue
        layers = model.layers
        self._num_heads = model.layout.num_heads
        self._head_dim = model.config.head_dim
        num_kv_heads = model.layout.num_kv_heads
        self._rope_store_attend = glue.rope_store_attend_for(
            self._num_heads, num_kv_heads, self._head_dim,
            heads_per_call(self._num_heads // num_kv_heads, self._head_dim),
            math.gcd(kv_cache.spec.block_size, 16),
        )
        words = model.embed_tokens.weight.dtype == torch.bfloat16
        self._order = lane_order(self._head_dim, words=words)
        self._eps = np.float32(model.config.rms_norm_eps)
        self._scale = np.float32(scale)
        self._window = sliding_window or 0
        # The norm before each layer, and the final norm after the last.
        self._input_norms = [kernel_array(layer.input_layernorm.weight.data) for layer in layers]
        self._input_norms.append(kernel_array(model.norm.weight.data))
        self._post_norms = [
            kernel_array(layer.post_attention_layernorm.weight.data) for layer in layers
        ]
        self._keys = [kernel_array(kv_cache.key_cache(i)) for i in range(len(layers))]
        self._values = [kernel_array(kv_cache.value_cache(i)) for i in range(len(layers))]

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, kv_cache: KVCache, scale: float, sliding_window: int | None
    ) -> DecodeBatchStep | None:
        """The compiled path for this model and cache (compiled now, or loaded from numba's
        cache); None where it cannot run (see the module's docstring)."""
        if not any(compiled_decode_fits(model, kv_cache, dtype) for dtype in COMPILED_DTYPES):
            return None
        step = cls(model, kv_cache, scale, sliding_window)
        step.compile()
        return step

    def compile(self) -> None:
        """One step of two tokens at position 0 of block 0 (their KV is overwritten when block
        0 is first used)."""
        self(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), [[0], [0]], [1, 1])

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Logits [rows, vocab] of row r's token `input_ids[r]` at position seq_lens[r] - 1 of
        the sequence whose blocks block_tables[r] lists (its slot included); writes their keys
        and values into the cache."""
        model, glue = self.model, self._glue
        rows = input_ids.shape[0]
        hidden = model.embed_tokens(input_ids)  # [rows, hidden], updated in place
        cos, signed_sin = model.rotary.cos_sin(positions, hidden.dtype)
        cos = kernel_array(cos[:, 0].contiguous())
        signed_sin = kernel_array(signed_sin[:, 0].contiguous())
        width = max(len(table) for table in block_tables)
        tables = np.zeros((rows, width), np.int32)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        lens = np.array(seq_lens, dtype=np.int32)
        query = np.empty((rows, self._num_heads, self._head_dim), np.float32)
        attended = np.empty_like(query)
        normed = torch.empty_like(hidden)
        hidden_array, normed_array = kernel_array(hidden), kernel_array(normed)
        run_parallel(glue.norm_rows, hidden_array, self._input_norms[0], self._eps, normed_array)
        for index, layer in enumerate(model.layers):
            qkv = layer.self_attn.qkv_proj(normed)
            attention = torch.empty(rows, self._num_heads * self._head_dim, dtype=hidden.dtype)
            run_parallel(
                self._rope_store_attend, kernel_array(qkv), cos, signed_sin, self._keys[index],
                self._values[index], tables, lens, self._window, self._scale, self._order,
                query, attended, kernel_array(attention),
            )
            projected = layer.self_attn.o_proj(attention)
            run_parallel(
                glue.add_norm_rows, hidden_array, kernel_array(projected), self._post_norms[index],
                self._eps, normed_array,
            )
            projected = layer.mlp(normed)  # torch's SiLU: vectorized, faster than scalar code
            run_parallel(
                glue.add_norm_rows, hidden_array, kernel_array(projected),
                self._input_norms[index + 1], self._eps, normed_array,
            )
        return model.lm_head(normed)
