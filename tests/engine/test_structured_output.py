"""Structured output: every constrained output is valid for its spec (JSON schema, JSON object,
regex, choice), greedy and seeded, beside unconstrained rows whose tokens it does not change,
under preemption and split between a prefill and a decode engine; a spec that does not compile
fails its request alone, and every block returns."""

from __future__ import annotations

import json
import random
import re
import sys
import threading

import pytest

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.llm_engine import LLMEngine, StepFailure
from pdserve.node.generation import Generation
from pdserve.prefill_node.prefill_engine import PrefillEngine
from pdserve.wire.limits import MAX_CHOICES, MAX_JSON_SCHEMA_DEPTH, MAX_REGEX_CHARS
from pdserve.wire.messages import Generate, RequestFailed, decode, encode
from pdserve.wire.structured_output import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["id", "ok", "color", "name"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,6}-[0-9]{1,3}"  # \d is any Unicode digit, some newer than Python knows
CHOICES = ["alpha", "beta", "gamma delta"]
SPECS = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
}


def follows_schema(text: str) -> bool:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    value = json.loads(text)
    return (
        isinstance(value, dict)
        and set(value) == set(SCHEMA["properties"])
        and type(value["id"]) is int
        and 0 <= value["id"] <= 999
        and type(value["ok"]) is bool
        and value["color"] in ("red", "green", "blue")
        and isinstance(value["name"], str)
        and len(value["name"]) <= 8
    )


def is_valid(spec: dict, text: str) -> bool:
    ((kind, body),) = spec.items()
    if kind == "json_schema":
        return body is SCHEMA and follows_schema(text)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(body, text) is not None
    return text in body


def check_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not engine.held_blocks
    assert not engine.has_unfinished_requests()


def params(spec: dict | None, seed: int | None, max_tokens: int = 120) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, structured_output=spec
    )


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in (5, 20, 40, 17)]


# -- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"yaml": "x"}, "unknown key"),
        ({"json_object": 1}, "json_object must be true"),
        ({"json_schema": "{}"}, "must be a JSON object"),
        ({"json_schema": {"maximum": float("nan")}}, "NaN"),
        ({"json_schema": {"maximum": 2**70}}, "beyond 64 bits"),
        ({"json_schema": {1: "x"}}, "string keys"),
        ({"regex": ""}, "non-empty string"),
        ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, f"at most {MAX_REGEX_CHARS:,}"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"choice": ["a"] * (MAX_CHOICES + 1)}, f"at most {MAX_CHOICES:,}"),
        ({"grammar": 5}, "non-empty string"),
    ],
)
def test_malformed_specs_are_refused_naming_the_field(spec, message):
    with pytest.raises(ValueError, match="structured_output") as info:
        SamplingParams(structured_output=spec)
    assert message in str(info.value)


def test_a_schema_nested_past_the_limit_is_refused():
    schema: dict = {"type": "string"}
    for _ in range(MAX_JSON_SCHEMA_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ValueError, match=f"at most {MAX_JSON_SCHEMA_DEPTH}"):
        SamplingParams(structured_output={"json_schema": schema})


def test_a_deeply_nested_schema_crosses_the_wire_unchanged():
    schema: dict = {"type": "string"}
    for _ in range(MAX_JSON_SCHEMA_DEPTH // 2 - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    sampling = SamplingParams(max_tokens=4, structured_output={"json_schema": schema})
    message = decode(encode(Generate("r", [1, 2], sampling)))
    assert message.sampling.structured_output == {"json_schema": schema}


# -- the tiny model: every output valid, neighbours unchanged ---------------------------------


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_outputs_are_valid(clean_tiny_llm, prompts, kind, seed):
    outputs = clean_tiny_llm.generate(prompts, params(SPECS[kind], seed))
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert is_valid(SPECS[kind], output.text), output.text


def test_a_json_object_output_that_ends_is_an_object(clean_tiny_llm, prompts):
    outputs = clean_tiny_llm.generate(prompts, params({"json_object": True}, None, 40))
    ended = [o for o in outputs if o.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(o.text), dict) for o in ended)


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_unconstrained_rows_keep_their_tokens_beside_constrained_ones(
    clean_tiny_llm, prompts, seed
):
    plain = [params(None, None if seed is None else seed + i, 30) for i in range(len(prompts))]
    constrained = [params(spec, seed) for spec in SPECS.values()]
    alone = clean_tiny_llm.generate(prompts, plain)
    constrained_alone = [
        clean_tiny_llm.generate(prompts[:1], p)[0].token_ids for p in constrained
    ]
    mixed = clean_tiny_llm.generate(
        prompts + prompts[:1] * len(constrained), plain + constrained
    )
    assert [o.token_ids for o in mixed[: len(prompts)]] == [o.token_ids for o in alone]
    assert [o.token_ids for o in mixed[len(prompts) :]] == constrained_alone
    for spec, output in zip(SPECS.values(), mixed[len(prompts) :]):
        assert is_valid(spec, output.text)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_with_identical_tokens(
    tiny_llama_dir, clean_tiny_llm, prompts, mode
):
    rng = random.Random(3)
    long_prompts = [[rng.randrange(3, 259) for _ in range(60)] for _ in range(6)]
    batch = [params(SPECS["json_schema"], None if i % 2 else i) for i in range(6)]
    expected = clean_tiny_llm.generate(long_prompts, batch)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, preemption_mode=mode)
    outputs = llm.generate(long_prompts, batch)
    assert llm.engine.scheduler.num_preemptions_by_mode[mode] > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert all(follows_schema(o.text) for o in outputs)
    check_clean(llm.engine)


# -- disaggregated: the first token sampled by the prefill engine -----------------------------


def split_generate(prefill: LLMEngine, decode: LLMEngine, prompts, params_list):
    """Prefill in one engine, decode in the other (tests/engine/test_disaggregated_engine.py's
    approach); returns each request's tokens and finish reason."""
    prefill_engine = PrefillEngine(prefill)
    targets, tokens, reasons = {}, {}, {}
    for index, (prompt, p) in enumerate(zip(prompts, params_list)):
        targets[f"r{index}"] = decode.reserve_blocks(len(prompt))
        prefill_engine.add(f"r{index}", prompt, p, targets[f"r{index}"])
    while prefill_engine.has_work():
        step = prefill_engine.step()
        for write in step.writes:
            src, dst = write.src_block_ids, write.dst_block_ids
            decode.runner.kv_cache.buffer[:, :, dst] = prefill.runner.kv_cache.buffer[:, :, src]
        for first in step.first_tokens:
            prefill_engine.release(first.request_id)
            index = int(first.request_id[1:])
            tokens[first.request_id] = [first.token_id]
            reasons[first.request_id] = decode.add_prefilled_request(
                first.request_id, prompts[index], params_list[index],
                targets[first.request_id], first.token_id,
            )
    while decode.has_unfinished_requests():
        for output in decode.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
            reasons[output.request_id] = output.finish_reason
    ids = [f"r{i}" for i in range(len(prompts))]
    return [tokens[r] for r in ids], [reasons[r] for r in ids]


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_split_prefill_and_decode_give_the_colocated_tokens(
    tiny_llama_dir, clean_tiny_llm, prompts, seed
):
    params_list = [params(spec, seed) for spec in SPECS.values()] + [params(None, seed, 20)]
    batch_prompts = prompts[: len(params_list)]
    expected = clean_tiny_llm.generate(batch_prompts, params_list)
    prefill = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=16)
    )
    decode_engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    tokens, reasons = split_generate(prefill, decode_engine, batch_prompts, params_list)
    assert tokens == [o.token_ids for o in expected]
    assert reasons == [o.finish_reason for o in expected]
    check_clean(prefill)
    check_clean(decode_engine)


def test_a_first_token_that_completes_the_grammar_ends_the_request_on_the_decode_side(
    tiny_llama_dir, clean_tiny_llm, prompts
):
    """Single-byte choices: the prefill engine's token is the whole output. The decode engine
    ends the request whether its grammar was still compiling (held) or cached."""
    single = params({"choice": ["x", "y", "z"]}, None)
    expected = clean_tiny_llm.generate(prompts[:1], single)[0]
    assert len(expected.token_ids) == 1 and expected.finish_reason == "stop"
    prefill = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    decode_engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    for _ in ("compiling", "cached"):
        tokens, reasons = split_generate(prefill, decode_engine, prompts[:1], [single])
        assert tokens == [expected.token_ids] and reasons == ["stop"]
    check_clean(prefill)
    check_clean(decode_engine)


# -- failures and holds -----------------------------------------------------------------------


def run_to_end(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, Exception]]:
    tokens: dict[str, list[int]] = {}
    errors: dict[str, Exception] = {}
    while engine.has_unfinished_requests():
        try:
            step = engine.step()
        except StepFailure as failure:
            errors.update(failure.errors)
            continue
        for output in step.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens, errors


def test_a_spec_that_does_not_compile_fails_its_request_alone(tiny_llama_dir, prompts):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    engine.add_request("good", prompts[0], params(SPECS["regex"], None))
    engine.add_request("bad-regex", prompts[1], params({"regex": "a(b"}, None))
    engine.add_request("plain", prompts[2], params(None, None, 10))
    engine.add_request("bad-schema", prompts[3], params({"json_schema": {"type": "x"}}, 1))
    tokens, errors = run_to_end(engine)
    assert set(errors) == {"bad-regex", "bad-schema"}
    assert all(isinstance(e, GrammarError) for e in errors.values())
    assert "structured_output.regex" in str(errors["bad-regex"])
    assert set(tokens) == {"good", "plain"} and len(tokens["plain"]) == 10
    assert re.fullmatch(REGEX, engine.tokenizer.decode(tokens["good"]))
    check_clean(engine)


def test_a_node_reports_a_spec_that_does_not_compile_as_a_400(tiny_llama_dir, prompts):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    generation = Generation(engine, "node")
    sampling = SamplingParams(
        max_tokens=8, structured_output={"grammar": "start: undefined_rule"}
    )
    assert generation.admit(Generate("bad", prompts[0], sampling)) is None
    messages = []
    while generation.engine.has_unfinished_requests():
        messages += generation.step()
    [failed] = messages
    assert isinstance(failed, RequestFailed) and failed.status == 400
    assert "structured_output.grammar" in failed.message
    check_clean(generation.engine)


def test_without_llguidance_only_constrained_requests_are_refused_naming_it(
    tiny_llama_dir, prompts, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now fails
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    with pytest.raises(ValueError, match="llguidance"):
        engine.add_request("constrained", prompts[0], params(SPECS["regex"], None))
    engine.add_request("plain", prompts[1], params(None, None, 5))
    tokens, errors = run_to_end(engine)
    assert not errors and len(tokens["plain"]) == 5
    check_clean(engine)


def test_a_held_request_blocks_no_one_and_can_be_aborted(tiny_llama_dir, prompts, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    structured = engine.structured_output
    compile_spec = structured._compile
    release = threading.Event()
    monkeypatch.setattr(structured, "_compile", lambda spec: release.wait(10) and compile_spec(spec))
    engine.add_request("held", prompts[0], params(SPECS["choice"], None))
    engine.add_request("aborted", prompts[1], params({"regex": "x+"}, None))
    engine.add_request("plain", prompts[2], params(None, None, 5))
    engine.abort_request("aborted")
    plain_tokens = []
    while len(plain_tokens) < 5:
        for output in engine.step().outputs:
            assert output.request_id == "plain"
            plain_tokens += output.new_token_ids
    assert structured.num_held == 1 and engine.has_unfinished_requests()
    release.set()
    tokens, errors = run_to_end(engine)
    assert not errors and engine.tokenizer.decode(tokens["held"]) in CHOICES
    check_clean(engine)


# -- the default model --------------------------------------------------------------------------

DEFAULT_MODEL_SPECS = {**SPECS, "json_object": {"json_object": True}}


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32")


@pytest.mark.default_model
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_default_model_constrained_outputs_are_valid(default_llm, seed):
    """A prompt the 135M model answers in a few tokens: left free, it can loop inside an
    unbounded JSON object until max_tokens, which is the model's doing, not the grammar's."""
    conversation = [
        {
            "role": "user",
            "content": "Reply with a JSON object with the keys name and age for Ada, who is 36.",
        }
    ]
    kinds = list(DEFAULT_MODEL_SPECS)
    outputs = default_llm.chat(
        [conversation] * len(kinds), [params(DEFAULT_MODEL_SPECS[k], seed, 100) for k in kinds]
    )
    for kind, output in zip(kinds, outputs):
        assert output.finish_reason == "stop", (kind, output.text)
        assert is_valid(DEFAULT_MODEL_SPECS[kind], output.text), (kind, output.text)
    default_llm.engine.check_integrity()
