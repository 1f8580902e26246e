"""Disaggregated serving with int8 weights on both nodes (`quantization="int8"`): a prefill node
(chunked prefill, 32 tokens a step) and a decode node in one process, KV moved by the in-process
transport, give the tokens of one colocated int8 engine, token for token, and every block of
both nodes returns."""

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


@pytest.fixture
def int8_nodes(tiny_llama_dir):
    int8 = {"quantization": "int8"}
    decode, prefill = make_nodes(tiny_llama_dir, int8, int8)
    try:
        yield decode, prefill
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_int8_disaggregated_tokens_equal_colocated_int8_tokens(int8_nodes, tiny_llama_dir):
    decode, prefill = int8_nodes
    prompts = [
        [(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 33, 70, 130))
    ]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    colocated = LLM(str(tiny_llama_dir), dtype="float32", quantization="int8")
    expected = [o.token_ids for o in colocated.generate(prompts, greedy)]

    submit(decode, prompts, 16)
    to_router = run_until_idle(decode, prefill)

    assert not [m for m in to_router if isinstance(m, RequestFailed)]
    tokens = tokens_by_request(to_router)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert_all_blocks_free(decode, prefill)
