"""Disaggregated serving with an fp8 KV cache on both nodes: a prefill node (chunked prefill, 32
tokens a step) and a decode node in one process, KV moved by the in-process transport, give the
tokens of one colocated fp8 engine, token for token, and every block of both nodes returns. A
prefill node whose KV cache is in the model's dtype cannot pair with an fp8 decode node: its
request fails at pairing, naming both dtypes, and after the router's abort every block returns.

Equality holds because the fp8 cache's attention reads what the cache holds even for a chunk
without context (engine/attention/torch_backend.py): how a prompt is chunked, and on which node,
changes nothing but float noise."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.decode_node.node import DecodeNode
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.prefill_node.node import PrefillNode
from pdserve.wire.messages import Abort, Generate, PrefillRequest, RequestFailed
from tests.nodes.test_disaggregated_nodes import (
    DEADLINE_S,
    PREFILL_ADDRESS,
    assert_all_blocks_free,
    run_until_idle,
    tokens_by_request,
)
from tests.nodes.unlooped import capture_sends, unlooped_config


def make_nodes(model_dir, decode: dict, prefill: dict) -> tuple[DecodeNode, PrefillNode]:
    """A decode node and a prefill node (chunks of 32 tokens) on the tiny model in fp32, over the
    in-process transport; `decode` / `prefill`: further EngineConfig fields of each."""
    tag = uuid.uuid4().hex[:10]

    def config(role: str):
        return unlooped_config(
            f"{role}{tag}",
            kv_transport="inprocess",
            kv_listen_address=f"ipc:///tmp/pdserve-test-{tag}",
        )

    def engine(**settings) -> EngineConfig:
        return EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=48, **settings)

    decode_node = DecodeNode(engine_config=engine(**decode), config=config("d"))
    prefill_node = PrefillNode(
        engine_config=engine(max_num_batched_tokens=32, **prefill), config=config("p")
    )
    capture_sends(decode_node)
    capture_sends(prefill_node)
    return decode_node, prefill_node


@pytest.fixture
def fp8_nodes(tiny_llama_dir):
    decode, prefill = make_nodes(
        tiny_llama_dir, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8"}
    )
    try:
        yield decode, prefill
    finally:
        prefill.shutdown()
        decode.shutdown()


def submit(decode: DecodeNode, prompts, max_tokens: int) -> None:
    for i, prompt in enumerate(prompts):
        decode.handle(
            Generate(
                f"r{i}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                prefill_address=PREFILL_ADDRESS,
            )
        )


def test_fp8_disaggregated_tokens_equal_colocated_fp8_tokens(fp8_nodes, tiny_llama_dir):
    decode, prefill = fp8_nodes
    assert decode.engine.runner.kv_cache.buffer.dtype == prefill.engine.runner.kv_cache.buffer.dtype
    prompts = [
        [(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 33, 70, 130))
    ]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    colocated = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype="fp8")
    expected = [o.token_ids for o in colocated.generate(prompts, greedy)]
    full = LLM(str(tiny_llama_dir), dtype="float32").generate(prompts, greedy)
    assert [o.token_ids for o in full] != expected, "fp8 should change some token here"

    submit(decode, prompts, 16)
    to_router = run_until_idle(decode, prefill)

    assert not [m for m in to_router if isinstance(m, RequestFailed)]
    tokens = tokens_by_request(to_router)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert_all_blocks_free(decode, prefill)


def refusal_at_pairing(decode: DecodeNode, prefill: PrefillNode) -> RequestFailed:
    """Submits one request and returns the prefill node's refusal of it."""
    submit(decode, [list(range(3, 40))], 4)
    failures = []
    deadline = time.monotonic() + DEADLINE_S
    while not failures:
        assert time.monotonic() < deadline, "the prefill node never refused the pair"
        decode.work()
        for message in decode.sent:
            if isinstance(message, PrefillRequest):
                prefill.handle(message)
        decode.sent.clear()
        prefill.work()
        failures += [m for m in prefill.sent if isinstance(m, RequestFailed)]
        prefill.sent.clear()
    (failure,) = failures
    return failure


def abort_and_check_every_block_returns(
    decode: DecodeNode, prefill: PrefillNode, failure: RequestFailed
) -> None:
    """The router's part after a refusal: it aborts the request on the decode node."""
    decode.handle(Abort(failure.request_id))
    run_until_idle(decode, prefill)
    assert not decode.pending and not prefill.requests
    assert_all_blocks_free(decode, prefill)


def test_an_fp8_decode_node_refuses_a_full_precision_prefill_node_naming_both(tiny_llama_dir):
    decode, prefill = make_nodes(
        tiny_llama_dir, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "auto"}
    )
    try:
        failure = refusal_at_pairing(decode, prefill)
        assert "dtype is 'float8_e4m3fn' on decode node" in failure.message
        assert "'float32' on this prefill node" in failure.message
        abort_and_check_every_block_returns(decode, prefill, failure)
    finally:
        prefill.shutdown()
        decode.shutdown()
