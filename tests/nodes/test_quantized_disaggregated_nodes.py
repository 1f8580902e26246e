"""Disaggregated serving with int8 or 4-bit weights on both nodes (`quantization="int8"`,
`"int4"`): a prefill node (chunked prefill, 32 tokens a step) and a decode node in one process,
KV moved by the in-process transport, give the tokens of one colocated engine of the same
weights, token for token, and every block of both nodes returns."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.wire.messages import RequestFailed
from tests.nodes.test_disaggregated_nodes import (
    assert_all_blocks_free,
    run_until_idle,
    tokens_by_request,
)
from tests.nodes.test_fp8_disaggregated_nodes import make_nodes, submit

# 4-bit linears round their inputs to int8 (kernels/cpu_int4_linear.py), so the fp32 rounding
# of another batch or prefill chunk can move a logit by ~0.2 (tests/engine/test_fp32_decode_step.py)
# and flip a near-tie: disaggregated int4 equals colocated int4 up to the first token where the
# colocated engine's top two were within NEAR_TIE nats. Measured on this model: one request of
# five parted, at its ninth token, where its top two were 0.04 nats apart.
NEAR_TIE = 0.5


@pytest.fixture(params=["int8", "int4"])
def quantized_nodes(request, tiny_llama_dir):
    quantized = {"quantization": request.param}
    decode, prefill = make_nodes(tiny_llama_dir, quantized, quantized)
    try:
        yield decode, prefill
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_quantized_disaggregated_tokens_equal_colocated_tokens(quantized_nodes, tiny_llama_dir):
    decode, prefill = quantized_nodes
    prompts = [
        [(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 33, 70, 130))
    ]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    quantization = decode.engine.config.quantization
    colocated = LLM(str(tiny_llama_dir), dtype="float32", quantization=quantization)
    expected = colocated.generate(prompts, greedy)

    submit(decode, prompts, 16)
    to_router = run_until_idle(decode, prefill)

    assert not [m for m in to_router if isinstance(m, RequestFailed)]
    tokens = tokens_by_request(to_router)
    got = [tokens[f"r{i}"] for i in range(len(prompts))]
    if quantization == "int8":
        assert got == [output.token_ids for output in expected]
    for disaggregated, output in zip(got, expected):
        assert len(disaggregated) == 16
        parted = next(
            (i for i, (a, b) in enumerate(zip(disaggregated, output.token_ids)) if a != b), None
        )
        if parted is not None:  # int4 only (above): a near-tie of the colocated engine's
            top = dict(output.logprobs[parted].top)
            assert disaggregated[parted] in top, (parted, top)
            gap = max(top.values()) - top[disaggregated[parted]]
            print(f"parted at {parted}: gap {gap:.4f} nats")
            assert gap <= NEAR_TIE, (parted, gap)
    assert_all_blocks_free(decode, prefill)
