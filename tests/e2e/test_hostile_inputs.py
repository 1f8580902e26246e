"""Hostile numbers and strings from clients, and requests that break a batched engine step.

Every number a client sends is bounded where it enters (router/validation.py) and again where it
meets a tensor (SamplingParams, the sampler); a request that still makes a batched step raise
fails alone (engine/llm_engine.py). The HTTP tests run the router in this process, so its
admission gauge can be read directly, against a real colocated node process on the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from pdserve.engine import SamplingParams
from pdserve.engine.llm_engine import StepFailure
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.wire.messages import Generate, NodeStats
from tests.nodes.test_colocated_node import Router, free_port
from tests.tiny_models import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
READY_TIMEOUT_S = 90.0
HUGE_TEXT = "x" * 500_000
PROMPTS = [[5, 17, 99, 300], [42] * 9, list(range(100, 131)), [7, 8], [300, 200, 100] * 5]


# -- the router and a real node ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    """(app, client): the router app in this process, a colocated node process behind it."""
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    log_path = tmp_path_factory.mktemp("hostile-node") / "stderr.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.colocated_node", "--model", str(tiny_llama_dir),
         "--listen", listen]
        + f"--router {router_address} --node-id node-0 --num-kv-blocks 128".split()
        + ["--num-threads", "1", "--heartbeat-interval", "0.2"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    config = RouterConfig(
        model_path=tiny_llama_dir,
        served_model_name=MODEL,
        node_addresses=[f"node-0={listen}"],
        listen_address=router_address,
    )
    app = create_app(config)
    try:
        with TestClient(app) as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while client.get("/health").status_code != 200:
                assert process.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "the node did not come up in time"
                time.sleep(0.2)
            yield app, client
            assert process.poll() is None, log_path.read_text()[-3000:]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


class Raw(str):
    """A JSON token written as it is: numbers Python's json turns into inf or refuses, and the
    NaN/Infinity tokens that JSON does not allow."""


def encode_body(body: dict) -> bytes:
    raws: dict[str, str] = {}

    def placeholder(value):
        if isinstance(value, Raw):
            key = f"__raw_{len(raws)}__"
            raws[key] = str(value)
            return key
        if isinstance(value, list):
            return [placeholder(v) for v in value]
        if isinstance(value, dict):
            return {k: placeholder(v) for k, v in value.items()}
        return value

    text = json.dumps(placeholder(body))
    for key, token in raws.items():
        text = text.replace(json.dumps(key), token)
    return text.encode()


def post(client: TestClient, path: str, body: dict):
    return client.post(path, content=encode_body(body), headers={"content-type": "application/json"})


def wait_admission_empty(app, timeout_s: float = 5.0) -> None:
    admission = app.state.router.admission
    deadline = time.monotonic() + timeout_s
    while admission.num_requests or admission.num_tokens:
        assert time.monotonic() < deadline, (
            f"admission holds {admission.num_requests} requests, {admission.num_tokens} tokens"
        )
        time.sleep(0.01)


def assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    assert len(error["message"]) < 600, error["message"][:600]
    return error


# -- hostile numbers and strings, property-based ---------------------------------------------

INT_EXTREMES = [
    0, -1, 1, 2, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
    -(2**64), 10**30,
]
FLOAT_EXTREMES = [1e-320, -1e-320, 1e-6, 0.5, 1.5, 100.0, 100.5, 1e308, -1e308, 2.0**64]
RAW_TOKENS = [
    Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"),
    Raw("9" * 5000),
]
WRONG_TYPES = [None, True, "7", "", "\ud800", [], [3], {}, {"a": 1}, HUGE_TEXT]
HOSTILE_VALUES = INT_EXTREMES + FLOAT_EXTREMES + RAW_TOKENS + WRONG_TYPES
# Ordinary values let a combination get past its first field to the checks behind it.
HOSTILE = st.sampled_from(HOSTILE_VALUES) | st.sampled_from([1, 2, 0.5, "ok", ["ok"]])

NUMERIC_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "min_tokens",
                  "priority"]
STRING_FIELDS = ["stop", "stop[]", "user", "model"]
COMPLETION_FIELDS = [*NUMERIC_FIELDS, *STRING_FIELDS, "logprobs", "prompt", "prompt[]",
                     "prompt[][]", "presence_penalty", "repetition_penalty", "min_p",
                     "logit_bias", "stop_token_ids", "unknown_field"]
CHAT_FIELDS = [*NUMERIC_FIELDS, *STRING_FIELDS, "max_completion_tokens", "logprobs",
               "top_logprobs", "content", "frequency_penalty", "logit_bias"]


def hostile_body(chat: bool, stream: bool, hostile: dict) -> dict:
    body: dict = {"model": MODEL, "max_tokens": 2, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for field, value in hostile.items():
        if field == "prompt[]":
            body["prompt"] = [5, value]
        elif field == "prompt[][]":  # a batch: a second prompt (or what stands for one)
            body["prompt"] = [[5, 6], value]
        elif field == "stop[]":
            body["stop"] = ["\n", value]
        elif field == "content":
            body["messages"][0]["content"] = value
        else:
            body[field] = value
    if "top_logprobs" in hostile and "logprobs" not in hostile:
        body["logprobs"] = True
    return body


def answer_events(response) -> list[dict]:
    """The JSON body, or each SSE event's payload."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return [response.json()]
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _param_root(param: str) -> str:
    return param.split("[")[0].split(".")[0]


def check_hostile(app, client, path: str, body: dict, hostile: dict) -> None:
    """Never a 5xx; a 400 for a body of valid JSON names a field the body has; admission is
    empty again once the answer is in."""
    response = post(client, path, body)
    status = response.status_code
    assert status == 200 or 400 <= status < 500, (status, response.text[:300], hostile)
    if status == 200:
        assert not any("error" in event for event in answer_events(response)), response.text[:300]
    else:
        error = response.json()["error"]
        assert error["message"], error
        raw = any(isinstance(v, Raw) for v in hostile.values())
        if status in (400, 404) and not raw:
            assert error["param"] is not None and _param_root(error["param"]) in body, (
                error, hostile
            )
    wait_admission_empty(app)


ENDPOINTS = [("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)]


@pytest.mark.parametrize(("path", "fields"), ENDPOINTS)
def test_every_field_at_every_extreme_gets_4xx_or_200(served, path, fields):
    """Each field alone at each extreme value (the sweep the property test below samples)."""
    app, client = served
    for field in fields:
        for value in HOSTILE_VALUES:
            hostile = {field: value}
            check_hostile(app, client, path, hostile_body(path.endswith("chat/completions"),
                                                          False, hostile), hostile)


@pytest.mark.parametrize(("path", "fields"), ENDPOINTS)
def test_hostile_fields_get_4xx_or_200_and_never_hold_admission(served, path, fields):
    """Up to three hostile fields at once, streamed or not."""
    app, client = served

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        hostile=st.dictionaries(st.sampled_from(fields), HOSTILE, min_size=1, max_size=3),
        stream=st.booleans(),
    )
    def run(hostile, stream):
        body = hostile_body(path.endswith("chat/completions"), stream, hostile)
        check_hostile(app, client, path, body, hostile)

    run()
    # the node served every request it was given and is still serving
    ok = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# -- the measured bugs, one by one -------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2**63, 2**64, 2**31, -2, -(2**64)])
def test_top_k_that_does_not_fit_int32_is_400_naming_top_k(served, top_k):
    app, client = served
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        assert_error(post(client, path, {**body, "top_k": top_k, "max_tokens": 2}), 400, "top_k")
    wait_admission_empty(app)


def test_top_k_beyond_the_vocabulary_keeps_the_whole_vocabulary(served):
    _, client = served
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    unfiltered = post(client, "/v1/completions", body)
    clamped = post(client, "/v1/completions", {**body, "top_k": 2**31 - 1})
    assert unfiltered.status_code == clamped.status_code == 200, clamped.text[:300]
    assert clamped.json()["choices"][0]["text"] == unfiltered.json()["choices"][0]["text"]


@pytest.mark.parametrize("min_tokens", [2**64, 2**63, 2**31, 2**31 - 1, 17])
def test_min_tokens_beyond_the_completion_limit_is_400_naming_min_tokens(served, min_tokens):
    app, client = served
    # completions: max_tokens defaults to 16; chat: the room the prompt leaves in the context
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "min_tokens": min_tokens}),
                 400, "min_tokens")
    if min_tokens > 1024:
        chat = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": min_tokens}
        assert_error(post(client, "/v1/chat/completions", chat), 400, "min_tokens")
    wait_admission_empty(app)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_that_does_not_fit_int32_is_400_naming_it(served, field):
    _, client = served
    body = {"messages": [{"role": "user", "content": "hi"}], field: 2**64}
    error = assert_error(post(client, "/v1/chat/completions", body), 400, field)
    assert "2,147,483,647" in error["message"]


def test_huge_token_ids_in_the_prompt_are_400_naming_prompt(served):
    _, client = served
    for token in (2**63, 2**64, -(2**64), 10**30):
        body = {"prompt": [5, token], "max_tokens": 2}
        assert_error(post(client, "/v1/completions", body), 400, "prompt")


def test_lone_surrogate_is_400_naming_the_field(served):
    app, client = served
    headers = {"content-type": "application/json"}
    r = client.post("/v1/completions", content=b'{"prompt": "\\ud800"}', headers=headers)
    assert_error(r, 400, "prompt")
    chat = b'{"messages": [{"role": "user", "content": "ok \\udfff"}]}'
    assert_error(client.post("/v1/chat/completions", content=chat, headers=headers), 400,
                 "messages[0].content")
    wait_admission_empty(app)


def test_any_tokenizer_failure_on_the_prompt_is_400_naming_prompt(served, monkeypatch):
    app, client = served

    def refuse(*args, **kwargs):
        raise RuntimeError("the tokenizer gave up")

    monkeypatch.setattr(app.state.router.tokenizer, "encode", refuse)
    error = assert_error(post(client, "/v1/completions", {"prompt": "fine text"}), 400, "prompt")
    assert "gave up" not in error["message"]


def test_huge_strings_are_refused_naming_the_field(served):
    app, client = served
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "stop": HUGE_TEXT}), 400, "stop")
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "stop": ["a", HUGE_TEXT]}),
                 400, "stop")
    assert_error(post(client, "/v1/completions", {"prompt": "hi", "user": HUGE_TEXT}), 400, "user")
    error = assert_error(post(client, "/v1/completions", {"prompt": "hi", "model": HUGE_TEXT}),
                         404, "model")
    assert len(error["message"]) < 200
    assert_error(post(client, "/v1/completions", {"prompt": HUGE_TEXT}), 400, "prompt")
    wait_admission_empty(app)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-6])
def test_temperature_below_1e_5_answers_as_greedy(served, temperature):
    _, client = served
    body = {"prompt": "hello there", "max_tokens": 8, "ignore_eos": True}
    greedy = post(client, "/v1/completions", {**body, "temperature": 0})
    tiny = post(client, "/v1/completions", {**body, "temperature": temperature})
    assert greedy.status_code == tiny.status_code == 200, tiny.text[:300]
    assert tiny.json()["usage"]["completion_tokens"] == 8
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


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

    def execute(step):
        if len(step.scheduled) > 1:
            raise RuntimeError("the batch is too big for the device")
        return real_execute(step)

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
    from pdserve.colocated_node.node import ColocatedNode
    from pdserve.engine.config import EngineConfig
    from pdserve.node.config import NodeConfig

    innocents = innocent_requests()
    outputs = clean_tiny_llm.generate(
        [prompt for prompt, _ in innocents.values()], [params for _, params in innocents.values()]
    )
    reference = {request_id: o.token_ids for request_id, o in zip(innocents, outputs)}

    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    node = ColocatedNode(
        engine_config=EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64),
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
            request_id: (prompt, {
                "temperature": params.temperature, "seed": params.seed,
                "max_tokens": params.max_tokens, "ignore_eos": True,
            })
            for request_id, (prompt, params) in innocents.items()
        }
        items = list(wire.items())
        items.insert(3, ("poisoned", ([5, 6, 7], {"temperature": 0, "max_tokens": 12})))
        items.insert(5, ("huge-top-k", ([5, 6], {"top_k": 2**63, "max_tokens": 4})))
        for request_id, (prompt, sampling) in items:
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
            NodeStats, lambda s: s.num_running == 0 and s.num_free_blocks == s.num_total_blocks
        )
        assert stats.num_leaked_blocks == 0
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert not thread.is_alive()
    node.engine.check_integrity()


def test_prefill_that_breaks_the_step_fails_alone_and_the_others_write_their_blocks_once(
    tiny_llama_dir, clean_tiny_llm
):
    """The prefill side of the same rule: the others' first tokens are right and each of their
    blocks goes to the decode node exactly once, though their step ran twice."""
    from pdserve.engine import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.prefill_node.prefill_engine import PrefillEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64))
    engine.runner.sampler = PoisonedSampler(engine.runner.sampler, "poisoned")
    written: dict[str, list[int]] = {}
    prefill = PrefillEngine(engine)
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
            step = prefill.step()
            for write in step.writes:
                written.setdefault(write.request_id, []).extend(write.dst_block_ids)
            firsts.update((first.request_id, first.token_id) for first in step.first_tokens)
        except StepFailure as failure:
            failures.update(failure.errors)
    assert set(failures) == {"poisoned"} and set(firsts) == set(prompts)
    reference = clean_tiny_llm.generate(list(prompts.values()), SamplingParams(temperature=0,
                                                                               max_tokens=1))
    assert [firsts[r] for r in prompts] == [o.token_ids[0] for o in reference]
    assert written == {request_id: targets[request_id] for request_id in prompts}
    for request_id in [*prompts, "poisoned"]:
        prefill.release(request_id)
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.held_blocks
