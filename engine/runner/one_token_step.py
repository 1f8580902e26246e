"""A step that decodes one sequence by one token, on the CPU in bf16, through every decoder layer
in one compiled call (kernels/cpu_decode_step.py) instead of torch's ops one by one.

`OneTokenStep.for_model` returns None unless every part it replaces has a compiled kernel here:
a bf16 Llama-family model on the CPU on one rank, every decoder linear with its one-token copy
(a CPU with AVX512-BF16: kernels/cpu_gemv.py), no q/k norms (Qwen3 keeps the torch path), a bf16
KV cache read by the compiled decode attention (head dim a multiple of 16). Elsewhere the model
runner keeps the torch forward for every step.

The runner takes it for a step of exactly one sequence decoding one token without prompt
logprobs; batches, prefills and scoring go through the torch forward, which writes and reads
the same KV cache. The embedding row, the final norm and the LM head stay torch modules (the
same calls the torch forward makes), so the logits differ from the torch path's only where the
compiled layers round in another order (the kernel's docstring says where).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.layers.linear import Linear
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.runner.decode_batch_step import compiled_decode_fits
from pdserve.kernels.cpu_gemv import bf16_words
from pdserve.kernels.numba_threads import run_parallel


class OneTokenStep:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, scale: float, sliding_window: int | None
    ) -> None:
        from numba.typed import List

        from pdserve.kernels import cpu_decode_step
        from pdserve.kernels.cpu_attention_chunk import lane_order
        from pdserve.kernels.cpu_decode_attention import heads_per_call

        self.model = model
        layers = model.layers
        config = model.config
        self._num_heads, self._num_kv_heads = model.layout.num_heads, model.layout.num_kv_heads
        self._head_dim = config.head_dim
        block_size = kv_cache.spec.block_size
        self._heads_per_call = heads_per_call(self._num_heads // self._num_kv_heads, self._head_dim)
        self._tokens_per_chunk = math.gcd(block_size, 16)
        self._order = lane_order(self._head_dim, words=True)
        self._eps = np.float32(config.rms_norm_eps)
        self._scale = np.float32(scale)
        self._window = sliding_window or 0
        self._kernel = cpu_decode_step.compiled_for(
            self._num_heads, self._num_kv_heads, self._head_dim, self._heads_per_call,
            self._tokens_per_chunk,
        )
        self._input_norms = np.stack([bf16_words(l.input_layernorm.weight.data) for l in layers])
        self._post_norms = np.stack(
            [bf16_words(l.post_attention_layernorm.weight.data) for l in layers]
        )

        def weights(linears: list[Linear]) -> tuple[List, List]:
            return (
                List([linear.one_token.weight_words for linear in linears]),
                List([linear.one_token.bias_words for linear in linears]),
            )

        self._qkv = weights([l.self_attn.qkv_proj for l in layers])
        self._o = weights([l.self_attn.o_proj for l in layers])
        self._gate_up = weights([l.mlp.gate_up_proj for l in layers])
        self._down = weights([l.mlp.down_proj for l in layers])
        self._key_caches = List([bf16_words(kv_cache.key_cache(i)) for i in range(len(layers))])
        self._value_caches = List([bf16_words(kv_cache.value_cache(i)) for i in range(len(layers))])

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None,
    ) -> OneTokenStep | None:
        """The compiled step for this model and cache (compiled now, or loaded from numba's
        cache); None where it cannot run (see the module's docstring)."""
        if not compiled_decode_fits(model, kv_cache):
            return None
        linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
        if not all(linear.one_token is not None for linear in linears):
            return None
        step = cls(model, kv_cache, scale, sliding_window)
        step.compile()
        return step

    def compile(self) -> None:
        """One step on a token at position 0 in block 0 (its KV is overwritten when block 0
        is first used)."""
        self(torch.zeros(1, dtype=torch.long), [0], 1)

    def __call__(
        self, input_ids: torch.Tensor, block_table: list[int], seq_len: int
    ) -> torch.Tensor:
        """Logits [1, vocab] of the token `input_ids` ([1]) at position seq_len - 1 of the
        sequence whose blocks `block_table` lists (the token's slot included); writes its keys
        and values into the cache."""
        model = self.model
        hidden = model.embed_tokens(input_ids)  # [1, hidden] bf16, the model's own buffer
        position = torch.tensor([seq_len - 1])
        cos, signed_sin = model.rotary.cos_sin(position, hidden.dtype)
        run_parallel(
            self._kernel, bf16_words(hidden)[0], self._input_norms, self._post_norms, self._eps,
            *self._qkv, *self._o, *self._gate_up, *self._down, self._key_caches,
            self._value_caches, bf16_words(cos)[0, 0], bf16_words(signed_sin)[0, 0],
            np.array([block_table], dtype=np.int32), np.array([seq_len], dtype=np.int32),
            self._window, self._scale, self._order,
        )
        return model.lm_head(model.norm(hidden))
