"""Hostile numbers that reach the engine, and requests that break a batched engine step.

Past the router's bounds (tests/e2e/test_hostile_inputs.py), every number is bounded again where
it meets a tensor (SamplingParams, the sampler); a request that still makes a batched step raise
fails alone (engine/step_failure.py), in the engine and in a node's loop, and the others keep the
tokens they would have had on their own.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from pdserve.engine import SamplingParams
from pdserve.engine.llm_engine import StepFailure
from pdserve.engine.sample.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.testing.tiny_models import VOCAB_SIZE
from pdserve.wire.messages import Generate, NodeStats
from tests.nodes.test_colocated_node import Router, free_port, raw_generate

PROMPTS = [[5, 17, 99, 300], [42] * 9, list(range(100, 131)), [7, 8], [300, 200, 100] * 5]


# -- the engine's own bounds -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**64, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 2**64}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop": 5}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_sampling_params_refuse_what_would_not_fit_a_tensor(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_temperature_below_1e_5_is_greedy_in_the_engine(clean_tiny_llm):
    params = SamplingParams(temperature=1e-320, max_tokens=12, ignore_eos=True)
    assert params.greedy and params.temperature == 0.0
    tiny = clean_tiny_llm.generate(PROMPTS, params)
    greedy = clean_tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                             ignore_eos=True))
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_sampler_bounds_parameters_changed_after_validation(clean_tiny_llm):
    """The sampler clamps on its own: parameters that skipped validation cannot overflow."""
    reference = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    huge_top_k = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    huge_top_k.top_k = 2**63
    tiny = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    tiny.temperature = 1e-320  # not flagged greedy, so sampled: clamped to 1e-5, i.e. argmax
    out = clean_tiny_llm.generate([PROMPTS[0]] * 3, [reference, huge_top_k, tiny])
    assert out[1].token_ids == out[0].token_ids  # top_k past the vocabulary filters nothing
    greedy = clean_tiny_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10,
                                                                  ignore_eos=True))
    assert out[2].token_ids == greedy[0].token_ids


def test_sampler_leaves_out_stop_token_ids_outside_the_vocabulary():
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    seq = Sequence("x", [1, 2], params, frozenset({7, 2**63, -5}), torch.device("cpu"))
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 7] = 10.0
    [sample] = Sampler(0, torch.device("cpu"))(logits, [seq])
    assert sample.token_id != 7  # suppressed before min_tokens; the others were left out


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_submission(clean_tiny_llm):
    with pytest.raises(ValueError, match=r"stop token id 512 is outside the vocabulary"):
        clean_tiny_llm.generate([PROMPTS[0]], SamplingParams(stop_token_ids=[512]))


# -- a request that breaks a batched step fails alone ------------------------------------------


def innocent_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """Seven requests: greedy ones and seeded sampled ones (whose tokens depend on their
    generator's state, so a lone run that consumed noise would change them)."""
    requests = {}
    for i in range(7):
        if i % 2:
            params = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        requests[f"ok-{i}"] = (PROMPTS[i % len(PROMPTS)] + [i + 3], params)
    return requests


def run_engine(engine, requests: dict) -> tuple[dict[str, list[int]], dict[str, Exception]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    failures: dict[str, Exception] = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step().outputs
        except StepFailure as failure:
            failures.update(failure.errors)
            continue
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
    return tokens, failures


def test_request_that_breaks_the_batched_step_fails_alone_in_the_engine(clean_tiny_llm):
    engine = clean_tiny_llm.engine
    innocents = innocent_requests()
    reference, failures = run_engine(engine, innocents)
    assert not failures
    poisoned = SamplingParams(temperature=1.0, max_tokens=12)
    poisoned.top_p = "not a number"  # passed validation, then broke: the sampler raises on it
    requests = dict(list(innocents.items())[:3])
    requests["poisoned"] = ([5, 6, 7], poisoned)
    requests.update(list(innocents.items())[3:])
    tokens, failures = run_engine(engine, requests)
    assert set(failures) == {"poisoned"}
    assert tokens.pop("poisoned") == []
    assert tokens == reference
    engine.check_integrity()


def test_lone_request_that_breaks_its_step_fails_with_its_own_error(clean_tiny_llm):
    engine = clean_tiny_llm.engine
    poisoned = SamplingParams(temperature=1.0, max_tokens=4)
    poisoned.top_p = "not a number"
    engine.add_request("alone", [5, 6, 7], poisoned)
    with pytest.raises(StepFailure) as info:
        engine.step()
    assert list(info.value.errors) == ["alone"]
    assert not engine.has_unfinished_requests()


def test_step_that_fails_only_when_batched_raises_its_own_error(clean_tiny_llm, monkeypatch):
    """No request fails alone: the fault is not a request's, and the caller fails them all."""
    engine = clean_tiny_llm.engine
    real_execute = engine.runner.execute

    def execute(step, layers_done=None):
        if len(step.scheduled) > 1:
            raise RuntimeError("the batch is too big for the device")
        return real_execute(step, layers_done)

    monkeypatch.setattr(engine.runner, "execute", execute)
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    with pytest.raises(RuntimeError, match="too big"):
        engine.step()
    engine.abort_request("a")
    engine.abort_request("b")


class PoisonedSampler:
    """The engine's sampler, except that it raises for any batch holding `poisoned_id`."""

    def __init__(self, sampler, poisoned_id: str) -> None:
        self.sampler = sampler
        self.poisoned_id = poisoned_id

    def __call__(self, logits, seqs):
        if any(seq.request_id == self.poisoned_id for seq in seqs):
            raise RuntimeError("this request breaks the sampler")
        return self.sampler(logits, seqs)


def test_request_that_breaks_the_node_step_fails_alone(tiny_llama_dir, clean_tiny_llm):
    """Eight requests in flight on a colocated node: the one that breaks the sampler gets a
    500, one whose top_k overflows int64 gets a 400 at admission, and the seven others finish
    with the tokens they would have had on their own."""
    from pdserve.engine.config import EngineConfig
    from pdserve.node.colocated import ColocatedNode
    from pdserve.node.config import NodeConfig

    innocents = innocent_requests()
    outputs = clean_tiny_llm.generate(
        [prompt for prompt, _ in innocents.values()], [params for _, params in innocents.values()]
    )
    reference = {request_id: o.token_ids for request_id, o in zip(innocents, outputs)}

    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    node = ColocatedNode(
        engine_config=EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64),
        config=NodeConfig(
            node_id="node-iso",
            listen_address=listen,
            router_address=router_address,
            heartbeat_interval=0.1,
        ),
    )
    node.engine.runner.sampler = PoisonedSampler(node.engine.runner.sampler, "poisoned")
    router = Router(zmq.Context(), listen, router_address)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        router.wait()
        wire = {
            request_id: (prompt, SamplingParams(
                temperature=params.temperature, seed=params.seed,
                max_tokens=params.max_tokens, ignore_eos=True,
            ))
            for request_id, (prompt, params) in innocents.items()
        }
        items = list(wire.items())
        items.insert(3, ("poisoned", ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12))))
        items.insert(5, ("huge-top-k", ([5, 6], {"top_k": 2**63, "max_tokens": 4})))
        for request_id, (prompt, sampling) in items:
            if isinstance(sampling, dict):  # not the router's: unchecked settings
                router.push.send(raw_generate(request_id, prompt, sampling))
            else:
                router.send(Generate(request_id, prompt, sampling))
        results = router.collect([request_id for request_id, _ in items])
        poisoned, huge = results.pop("poisoned"), results.pop("huge-top-k")
        assert poisoned["failed"] is not None and poisoned["failed"].status == 500
        assert huge["failed"] is not None and huge["failed"].status == 400
        assert "top_k" in huge["failed"].message
        for request_id, result in results.items():
            assert result["failed"] is None, (request_id, result["failed"])
            assert result["tokens"] == reference[request_id], request_id
        stats = router.wait(
            NodeStats,
            lambda s: s.scheduling.num_running == 0
            and s.kv.num_free_blocks == s.kv.num_total_blocks,
        )
        assert stats.kv.num_leaked_blocks == 0
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert not thread.is_alive()
    node.engine.check_integrity()


@pytest.mark.parametrize("layers_per_write", [None, 1], ids=["after-forward", "per-layer"])
def test_prefill_that_breaks_the_step_fails_alone_and_the_others_write_their_blocks_once(
    tiny_llama_dir, clean_tiny_llm, layers_per_write
):
    """The prefill side of the same rule: the others' first tokens are right and each layer of
    each of their blocks goes to the decode node exactly once, though their step ran twice."""
    from pdserve.engine import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.prefill_node.prefill_engine import PrefillEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    engine.runner.sampler = PoisonedSampler(engine.runner.sampler, "poisoned")
    written: dict[str, list[int]] = {}
    block_layers_written: list[tuple[str, int, int]] = []
    prefill = PrefillEngine(engine, layers_per_write)
    num_layers = engine.model_config.num_layers

    def issue(write):
        if write.layer_start == 0 and write.request_id != "poisoned":
            written.setdefault(write.request_id, []).extend(write.dst_block_ids)
        layers = range(write.layer_start, write.layer_end or num_layers)
        block_layers_written.extend(
            (write.request_id, b, layer) for b in write.dst_block_ids for layer in layers
        )

    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = {f"p{i}": [(7 * i + j) % 500 + 3 for j in range(10 + 9 * i)] for i in range(5)}
    targets = {}
    for request_id, prompt in [*prompts.items(), ("poisoned", [5, 6, 7])]:
        targets[request_id] = list(range(1000, 1000 + engine.block_manager.blocks_for_tokens(
            len(prompt))))
        prefill.add(request_id, prompt, greedy, targets[request_id])
    firsts, failures = {}, {}
    while prefill.has_work():
        try:
            step = prefill.step(issue)
            firsts.update((first.request_id, first.token_id) for first in step.first_tokens)
        except StepFailure as failure:
            failures.update(failure.errors)
    assert set(failures) == {"poisoned"} and set(firsts) == set(prompts)
    reference = clean_tiny_llm.generate(list(prompts.values()), SamplingParams(temperature=0,
                                                                               max_tokens=1))
    assert [firsts[r] for r in prompts] == [o.token_ids[0] for o in reference]
    assert written == {request_id: targets[request_id] for request_id in prompts}
    poisoned = [pair for pair in block_layers_written if pair[0] == "poisoned"]
    assert all(layer < num_layers - 1 for _, _, layer in poisoned)  # its KV never all left
    expected = {(r, b, layer) for r in prompts for b in targets[r] for layer in range(num_layers)}
    assert sorted(set(block_layers_written) - set(poisoned)) == sorted(expected)
    assert len(block_layers_written) - len(poisoned) == len(expected)  # each pair once
    for request_id in [*prompts, "poisoned"]:
        prefill.release(request_id)
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.held_blocks
