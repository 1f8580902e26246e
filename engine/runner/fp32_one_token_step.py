"""A step that decodes one sequence by one token with fp32 activations, through every decoder
layer in one compiled call (kernels/cpu_fp32_decode_step.py) instead of torch's ops one by one,
its weights int8 (`--quantization int8`), 4-bit (`--quantization int4`) or fp32. It runs on
any CPU numba compiles for: the fp32 counterpart of engine/runner/one_token_step.py (bf16 on
AVX512-BF16).

`Fp32OneTokenStep.for_model` returns None unless every part it replaces has a compiled kernel
here: an fp32 Llama-family model on the CPU on one rank, every decoder linear int8
(engine/layers/int8_weight.py), every one 4-bit (int4_weight.py) or every one with its fp32
row-major copy (engine/layers/linear.py's `Fp32OneTokenWeight`), no q/k norms (Qwen3 keeps the
torch path), an fp32 KV cache read by the compiled decode attention (head dim a multiple of
16). The runner takes it for a step of exactly one sequence decoding one token without prompt
logprobs; batches, prefills and scoring go through the torch forward, which writes and reads the
same KV cache with the same weights. The embedding row, the final norm and the LM head stay the
model's modules (the head's one-token forward reads its own row-major copy).

Why fp32 too. A batch-1 fp32 step reads 538 MB of the default model's weights; through torch
each linear is a oneDNN call that reads them at 13 GB/s (2-core AMD EPYC held to AVX2), here the
same loops read them at 30-35 GB/s. fp32 weights run the int8 kernel with every scale 1, so the
step computes exactly what the torch forward does, up to the order of fp32 sums.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.layers.int4_weight import Int4Weight
from pdserve.engine.layers.int8_weight import Int8Weight
from pdserve.engine.layers.linear import Fp32OneTokenWeight, Linear
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.runner.decode_batch_step import compiled_decode_fits
from pdserve.kernels.numba_threads import run_parallel


def fp32_decode_fits(model: torch.nn.Module, kv_cache: KVCache) -> bool:
    """Whether the compiled fp32 step covers this model and cache (see the module's docstring)."""
    if not compiled_decode_fits(model, kv_cache, torch.float32):
        return False
    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    forms = {type(linear.quantized or linear.one_token) for linear in linears}
    return len(forms) == 1 and forms <= {Int8Weight, Int4Weight, Fp32OneTokenWeight}


def _weight_lists(linears: list[Linear]) -> tuple:
    """The kernel's typed lists for these linears: weights ([out, in] int8, or fp32 with
    scales of one; or 4-bit panels), fp32 scales ([out]; empty for 4-bit) and fp32 biases (empty
    for none)."""
    from numba.typed import List

    nothing = np.zeros(0, np.float32)
    forms = [linear.quantized or linear.one_token for linear in linears]
    if isinstance(forms[0], Int4Weight):
        weights, scales = [form.panels.numpy() for form in forms], [nothing for _ in forms]
    else:
        weights = [
            form.quantized.numpy() if isinstance(form, Int8Weight) else form.weight.numpy()
            for form in forms
        ]
        scales = [form.scale.numpy() for form in forms]
    biases = [nothing if form.bias is None else form.bias.numpy() for form in forms]
    return List(weights), List(scales), List(biases)


class Fp32OneTokenStep:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, scale: float, sliding_window: int | None
    ) -> None:
        from numba.typed import List

        from pdserve.kernels import cpu_fp32_decode_step
        from pdserve.kernels.cpu_attention_chunk import lane_order
        from pdserve.kernels.cpu_decode_attention import heads_per_call

        self.model = model
        layers = model.layers
        config = model.config
        num_heads, num_kv_heads = model.layout.num_heads, model.layout.num_kv_heads
        head_dim = config.head_dim
        self._kernel = cpu_fp32_decode_step.compiled_for(
            num_heads, num_kv_heads, head_dim, heads_per_call(num_heads // num_kv_heads, head_dim),
            math.gcd(kv_cache.spec.block_size, 16),
        )
        self._order = lane_order(head_dim, words=False)
        self._eps = np.float32(config.rms_norm_eps)
        self._intermediate = layers[0].mlp.down_proj.in_features
        self._scale = np.float32(scale)
        self._window = sliding_window or 0
        self._input_norms = np.stack([l.input_layernorm.weight.data.numpy() for l in layers])
        self._post_norms = np.stack([l.post_attention_layernorm.weight.data.numpy() for l in layers])

        self._qkv = _weight_lists([l.self_attn.qkv_proj for l in layers])
        self._o = _weight_lists([l.self_attn.o_proj for l in layers])
        self._gate_up = _weight_lists([l.mlp.gate_up_proj for l in layers])
        self._down = _weight_lists([l.mlp.down_proj for l in layers])
        self._key_caches = List([kv_cache.key_cache(i).numpy() for i in range(len(layers))])
        self._value_caches = List([kv_cache.value_cache(i).numpy() for i in range(len(layers))])

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None,
    ) -> Fp32OneTokenStep | None:
        """The compiled step for this model and cache (compiled now, or loaded from numba's
        cache); None where it cannot run (see the module's docstring)."""
        if not fp32_decode_fits(model, kv_cache):
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
        hidden = model.embed_tokens(input_ids)  # [1, hidden] fp32, a fresh tensor
        cos, signed_sin = model.rotary.cos_sin(torch.tensor([seq_len - 1]), hidden.dtype)
        run_parallel(
            self._kernel, hidden.numpy(), self._input_norms, self._post_norms, self._eps,
            self._intermediate,
            *self._qkv, *self._o, *self._gate_up, *self._down, self._key_caches,
            self._value_caches, cos[0, 0].numpy(), signed_sin[0, 0].numpy(),
            np.array([block_table], dtype=np.int32), np.array([seq_len], dtype=np.int32),
            self._window, self._scale, self._order, torch.get_num_threads(),
        )
        return model.lm_head(model.norm(hidden))
