"""A prefill node and a decode node in one process, their KV moved by the in-process transport
and their messages handed over by the test: the tokens of every request equal the offline
engine's, streamed in order from offset 0 (the prefill node's first token) on; an aborted request
ends on both nodes; afterwards every block of both nodes is free again.

The node loops do not run: the test calls `handle` and `work` itself, so everything between the
router's Generate and the last TokenUpdate is exercised without a socket or a second process."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.decode_node.node import DecodeNode
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.node.config import NodeConfig
from pdserve.prefill_node.node import PrefillNode
from pdserve.wire.messages import (
    Abort,
    Choice,
    Generate,
    PrefillDone,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
)
from tests.nodes.unlooped import capture_sends, unlooped_config

PREFILL_ADDRESS = "tcp://127.0.0.1:3"
DEADLINE_S = 60.0


@pytest.fixture
def nodes(tiny_llama_dir, request):
    """By default the prefill node writes each layer of the tiny model's two as its own group;
    a test parametrized with `kv_layers_per_write` sets that instead."""
    tag = uuid.uuid4().hex[:10]
    layers_per_write = getattr(request, "param", 1)

    def config(role: str) -> NodeConfig:
        return unlooped_config(
            f"{role}{tag}",
            kv_transport="inprocess",
            kv_listen_address=f"ipc:///tmp/pdserve-test-{tag}",
            kv_layers_per_write=layers_per_write,
        )

    decode = DecodeNode(
        engine_config=EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=48),
        config=config("d"),
    )
    prefill = PrefillNode(
        engine_config=EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=48, max_num_batched_tokens=32
        ),
        config=config("p"),
    )
    capture_sends(decode)
    capture_sends(prefill)
    try:
        yield decode, prefill
    finally:
        prefill.shutdown()
        decode.shutdown()


def run_until_idle(decode: DecodeNode, prefill: PrefillNode) -> list:
    """Hands messages between the nodes until both are idle; the messages for the router."""
    to_router = []
    deadline = time.monotonic() + DEADLINE_S
    while decode.busy() or decode.pending or prefill.busy():
        assert time.monotonic() < deadline, "the nodes did not finish in time"
        decode.work()
        for message in decode.sent:
            if isinstance(message, PrefillRequest):
                prefill.handle(message)
            else:
                to_router.append(message)
        decode.sent.clear()
        prefill.work()
        for message in prefill.sent:
            if isinstance(message, PrefillDone):
                decode.handle(message)
            else:
                to_router.append(message)
        prefill.sent.clear()
    return to_router


def tokens_by_request(to_router: list) -> dict[str, list[int]]:
    """Each request's tokens, put in order by offset as the router does; every offset once."""
    updates: dict[str, list] = {}
    for message in to_router:
        if isinstance(message, TokenBatch):
            for update in message.updates:
                updates.setdefault(update.request_id, []).append(update)
    tokens = {}
    for request_id, request_updates in updates.items():
        request_updates.sort(key=lambda u: u.offset)
        offsets = [u.offset + i for u in request_updates for i in range(len(u.token_ids))]
        assert offsets == list(range(len(offsets))), (request_id, offsets)
        tokens[request_id] = [t for u in request_updates for t in u.token_ids]
    return tokens


def assert_all_blocks_free(*nodes) -> None:
    for node in nodes:
        node.engine.check_integrity()
        manager = node.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks, node.node_id
        assert not node.engine.held_blocks, node.node_id


@pytest.mark.parametrize("nodes", [None], ids=["default"], indirect=True)
def test_on_a_cpu_a_chunk_leaves_in_one_write_after_its_forward_by_default(nodes):
    _, prefill = nodes
    num_layers = prefill.engine.model_config.num_layers
    assert prefill.engine.runner.device.type == "cpu"
    assert prefill.prefill.group_ends == (num_layers,)


@pytest.mark.parametrize("nodes", [1, 2], ids=["layer-groups", "after-forward"], indirect=True)
def test_tokens_equal_the_offline_engine_and_every_block_returns(nodes, tiny_llama_dir):
    decode, prefill = nodes
    prompts = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 16, 33, 70))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(str(tiny_llama_dir), dtype="float32")
    expected = [o.token_ids for o in offline.generate(prompts, greedy)]
    for i, prompt in enumerate(prompts):
        decode.handle(
            Generate(
                f"r{i}",
                prompt,
                greedy,
                prefill_address=PREFILL_ADDRESS,
            )
        )
    to_router = run_until_idle(decode, prefill)
    assert not [m for m in to_router if isinstance(m, RequestFailed)]
    tokens = tokens_by_request(to_router)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert_all_blocks_free(decode, prefill)


def test_an_abort_ends_the_request_on_both_nodes(nodes):
    decode, prefill = nodes
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    decode.handle(Generate("long", list(range(3, 90)), params, prefill_address=PREFILL_ADDRESS))
    deadline = time.monotonic() + DEADLINE_S
    while not prefill.requests:  # the prefill node has it: its KV is being written
        assert time.monotonic() < deadline
        decode.work()
        for message in decode.sent:
            if isinstance(message, PrefillRequest):
                prefill.handle(message)
        decode.sent.clear()
    prefill.work()  # one chunk computed and written
    for node in (decode, prefill):
        node.handle(Abort("long"))
    run_until_idle(decode, prefill)
    while prefill.requests and time.monotonic() < deadline:  # its transfer's FAILED event
        prefill.work()
    assert not prefill.requests and not decode.pending
    assert_all_blocks_free(decode, prefill)


def test_prompt_logprobs_come_from_the_prefill_node_with_the_first_token(nodes, tiny_llama_dir):
    decode, prefill = nodes
    prompt = [(11 * j) % 400 + 3 for j in range(45)]  # two chunks of the prefill node's 32
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    decode.handle(Generate("s0", prompt, sampling, prefill_address=PREFILL_ADDRESS))
    to_router = run_until_idle(decode, prefill)
    updates = [u for m in to_router if isinstance(m, TokenBatch) for u in m.updates]
    scored = [u for u in updates if u.prompt_logprobs is not None]
    assert len(scored) == 1 and scored[0].offset == 0  # the prefill node's, and only once
    offline = LLM(str(tiny_llama_dir), dtype="float32").engine
    offline.add_request("s0", prompt, sampling)
    expected = None
    while offline.has_unfinished_requests():
        for output in offline.step().outputs:
            expected = expected or output.prompt_logprobs
    assert [entry[0] for entry in scored[0].prompt_logprobs] == prompt[1:]
    for got, want in zip(scored[0].prompt_logprobs, expected):
        assert got[2] == want.rank and [t for t, _ in got[3]] == [t for t, _ in want.top]
        assert abs(got[1] - want.logprob) < 1e-4
    assert len(tokens_by_request(to_router)["s0"]) == 4
    assert_all_blocks_free(decode, prefill)


def choices_for(sampling: dict, n: int, prefix: str) -> list[Choice]:
    return [
        Choice(f"{prefix}{i}", SamplingParams(**{**sampling, "seed": sampling["seed"] + i}))
        for i in range(n)
    ]


def offline_choices(tiny_llama_dir, prompt: list[int], choices: list[Choice]) -> dict:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    outputs = llm.generate([prompt] * len(choices), [c.sampling for c in choices])
    return {c.request_id: o.token_ids for c, o in zip(choices, outputs)}


SEEDED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "ignore_eos": True, "seed": 77}


def test_n_choices_share_one_prefill_and_one_transfer(nodes, tiny_llama_dir):
    decode, prefill = nodes
    prompt = [(13 * j) % 400 + 3 for j in range(45)]  # 2 full blocks and a partial one
    choices = choices_for(SEEDED, 4, "c")
    expected = offline_choices(tiny_llama_dir, prompt, choices)
    prefill_requests, prefill_dones = [], []
    original_handle = prefill.handle

    def counting_handle(message):
        prefill_requests.append(message)
        original_handle(message)

    prefill.handle = counting_handle
    original_decode_handle = decode.handle

    def decode_handle(message):
        if isinstance(message, PrefillDone):
            prefill_dones.append(message)
        original_decode_handle(message)

    decode.handle = decode_handle
    decode.handle(
        Generate("p", prompt, choices[0].sampling, prefill_address=PREFILL_ADDRESS, choices=choices)
    )
    to_router = run_until_idle(decode, prefill)
    assert not [m for m in to_router if isinstance(m, RequestFailed)]
    assert tokens_by_request(to_router) == expected
    assert len(prefill_requests) == 1 and len(prefill_dones) == 1
    assert [c.request_id for c in prefill_dones[0].choices] == list(expected)
    bytes_per_block = prefill.engine.runner.kv_cache.spec.bytes_per_block
    assert prefill.transfer_bytes == 3 * bytes_per_block  # the prompt's blocks, once
    assert prefill.engine.num_prompt_tokens_computed == len(prompt)
    assert decode.engine.num_prompt_tokens_computed == 0
    assert decode.engine.block_manager.num_copied_blocks == 3  # the partial block, copied
    assert decode.stats().scheduling.prompt_tokens_computed_total == 0
    assert prefill.stats().scheduling.prompt_tokens_computed_total == len(prompt)
    assert_all_blocks_free(decode, prefill)


def test_aborting_one_choice_leaves_the_others_on_both_nodes(nodes, tiny_llama_dir):
    decode, prefill = nodes
    prompt = [(17 * j) % 400 + 3 for j in range(70)]  # three chunks of the prefill node's 32
    choices = choices_for(SEEDED, 3, "a")
    expected = offline_choices(tiny_llama_dir, prompt, choices)
    decode.handle(
        Generate("q", prompt, choices[0].sampling, prefill_address=PREFILL_ADDRESS, choices=choices)
    )
    for node in (decode, prefill):  # before the prefill node has it: both drop the choice
        node.handle(Abort("a1"))
    to_router = run_until_idle(decode, prefill)
    tokens = tokens_by_request(to_router)
    assert tokens == {"a0": expected["a0"], "a2": expected["a2"]}
    assert_all_blocks_free(decode, prefill)

    decode.handle(
        Generate("r", prompt, choices[0].sampling, prefill_address=PREFILL_ADDRESS, choices=choices)
    )
    for choice in choices:  # every choice: the whole request goes
        for node in (decode, prefill):
            node.handle(Abort(choice.request_id))
    assert not decode.pending and not decode.prompt_of
    run_until_idle(decode, prefill)
    assert_all_blocks_free(decode, prefill)


def test_n_choices_served_colocated_equal_lone_requests(nodes, tiny_llama_dir):
    decode, _ = nodes
    prompt = [(19 * j) % 400 + 3 for j in range(29)]
    choices = choices_for(SEEDED, 3, "l")
    expected = offline_choices(tiny_llama_dir, prompt, choices)
    decode.handle(Generate("l", prompt, choices[0].sampling, choices=choices))
    to_router = []
    while decode.busy():
        decode.work()
        to_router += decode.sent
        decode.sent.clear()
    assert tokens_by_request(to_router) == expected
    assert decode.engine.num_prompt_tokens_computed == len(prompt)
    assert_all_blocks_free(decode)
