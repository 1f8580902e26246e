"""`pdserve plan`: KV bytes per token and per sequence, weights from shapes, concurrency."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.commands.plan import KNOWN_MODELS, parse_bytes, plan_capacity, resolve_shape


def test_llama_3_8b_needs_128_kib_per_token_in_bf16():
    plan = plan_capacity(resolve_shape("llama-3-8b"), "bf16", 80 << 30, 0.1, [4096, 8192])
    assert plan.kv_bytes_per_token == 128 << 10
    assert [s.kv_bytes for s in plan.sequences] == [512 << 20, 1 << 30]
    assert round(KNOWN_MODELS["llama-3-8b"].num_parameters / 1e9, 2) == 8.03


def test_parameter_counts_match_the_published_sizes():
    published = {"llama-3-70b": 70.55e9, "qwen2.5-7b": 7.62e9, "smollm2-135m": 134.5e6}
    for name, count in published.items():
        assert KNOWN_MODELS[name].num_parameters == pytest.approx(count, rel=0.01), name


def test_concurrency_is_the_budget_over_whole_blocks_per_sequence():
    shape = KNOWN_MODELS["smollm2-135m"]
    plan = plan_capacity(shape, "fp32", 2 << 30, 0.25, [1, 16, 17], block_size=16)
    per_token = 2 * 30 * 3 * 64 * 4
    budget = (2 << 30) - shape.num_parameters * 4 - (2 << 30) // 4
    assert plan.kv_bytes_per_token == per_token == 46080
    assert [s.kv_bytes for s in plan.sequences] == [16 * per_token, 16 * per_token, 32 * per_token]
    assert [s.max_concurrency for s in plan.sequences] == [
        budget // (16 * per_token), budget // (16 * per_token), budget // (32 * per_token)
    ]


def test_a_model_folder_is_read_from_its_config(tiny_llama_dir):
    shape = resolve_shape(str(tiny_llama_dir))
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert shape.num_layers == config["num_hidden_layers"]
    assert shape.num_kv_heads == config["num_key_value_heads"]


def test_bad_names_and_sizes_are_refused():
    with pytest.raises(ValueError, match="known"):
        resolve_shape("gpt-7")
    with pytest.raises(ValueError, match="dtype"):
        plan_capacity(KNOWN_MODELS["llama-3-8b"], "int3", 1 << 30, 0.1, [16])
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000


def test_the_command_prints_json_with_kv_bytes_per_token():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "plan", "--model", "llama-3-8b", "--json"],
        capture_output=True, text=True, check=True,
    )
    data = json.loads(out.stdout)
    assert data["kv_bytes_per_token"] == 131072
    assert {s["tokens"]: s["kv_bytes"] for s in data["sequences"]}[8192] == 1 << 30


def test_an_fp8_kv_cache_doubles_bf16_concurrency_and_quadruples_fp32():
    shape = KNOWN_MODELS["llama-3-8b"]
    seq_lens = [1024, 8192, 32768]
    for dtype, factor in (("bf16", 2), ("fp32", 4)):
        model_dtype = plan_capacity(shape, dtype, 80 << 30, 0.1, seq_lens)
        fp8 = plan_capacity(shape, dtype, 80 << 30, 0.1, seq_lens, kv_cache_dtype="fp8_e4m3")
        assert fp8.kv_cache_dtype == "fp8_e4m3" and model_dtype.kv_cache_dtype == "auto"
        assert fp8.kv_budget_bytes == model_dtype.kv_budget_bytes  # weights stay in dtype
        assert fp8.kv_bytes_per_token * factor == model_dtype.kv_bytes_per_token
        assert fp8.kv_bytes_per_token == 64 << 10
        for wide, narrow in zip(model_dtype.sequences, fp8.sequences):
            assert narrow.kv_bytes * factor == wide.kv_bytes
            assert narrow.max_concurrency == fp8.kv_budget_bytes // (wide.kv_bytes // factor)
            assert factor * wide.max_concurrency <= narrow.max_concurrency < factor * (
                wide.max_concurrency + 1
            )
    assert plan_capacity(shape, "bf16", 80 << 30, 0.1, [1024], kv_cache_dtype="fp8") == (
        plan_capacity(shape, "bf16", 80 << 30, 0.1, [1024], kv_cache_dtype="fp8_e4m3")
    )
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        plan_capacity(shape, "bf16", 80 << 30, 0.1, [1024], kv_cache_dtype="int4")


def test_the_command_takes_the_kv_cache_dtype_flag_generated_from_engine_config():
    from pdserve.commands.cli import build_parser

    args = build_parser().parse_args(["plan", "--model", "llama-3-8b", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    assert build_parser().parse_args(["plan", "--model", "x"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--model", "x", "--kv-cache-dtype", "int4"])
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "plan", "--model", "llama-3-8b", "--json",
         "--kv-cache-dtype", "fp8_e4m3", "--seq-lens", "8192"],
        capture_output=True, text=True, check=True,
    )
    data = json.loads(out.stdout)
    assert data["kv_cache_dtype"] == "fp8_e4m3" and data["kv_bytes_per_token"] == 65536
    assert data["sequences"][0]["max_concurrency"] == 114  # bf16 KV: 57


def test_tensor_parallelism_splits_weights_and_kv_per_device():
    shape = KNOWN_MODELS["llama-3-70b"]
    seq_lens = [1024, 8192]
    one = plan_capacity(shape, "bf16", 80 << 30, 0.1, seq_lens)
    four = plan_capacity(shape, "bf16", 80 << 30, 0.1, seq_lens, tensor_parallel_size=4)
    assert one.kv_budget_bytes == 0, "70B in bf16 does not fit one 80 GiB device"
    assert four.tensor_parallel_size == 4
    assert four.kv_bytes_per_token * 4 == one.kv_bytes_per_token == 320 << 10
    # Every matrix is split four ways; only the norms (81 x 8192 parameters) are whole on each.
    norms = (2 * 80 + 1) * 8192
    assert four.weight_bytes == ((shape.num_parameters - norms) // 4 + norms) * 2
    assert [s.max_concurrency for s in four.sequences] == [
        four.kv_budget_bytes // (1024 * (80 << 10)), four.kv_budget_bytes // (8192 * (80 << 10))
    ]


def test_more_ranks_than_kv_heads_replicate_them():
    shape = KNOWN_MODELS["llama-3-8b"]  # 8 KV heads
    eight = plan_capacity(shape, "bf16", 80 << 30, 0.1, [1024], tensor_parallel_size=8)
    sixteen = plan_capacity(shape, "bf16", 80 << 30, 0.1, [1024], tensor_parallel_size=16)
    assert eight.kv_bytes_per_token == sixteen.kv_bytes_per_token == 2 * 32 * 1 * 128 * 2
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        plan_capacity(KNOWN_MODELS["smollm2-135m"], "bf16", 1 << 30, 0.1, [16],
                      tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        plan_capacity(shape, "bf16", 1 << 30, 0.1, [16], tensor_parallel_size=0)


def test_the_command_takes_the_tensor_parallel_flag_generated_from_engine_config():
    from pdserve.commands.cli import build_parser

    assert build_parser().parse_args(["plan", "--model", "x", "-tp", "4"]).tensor_parallel_size == 4
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "plan", "--model", "llama-3-70b", "--json",
         "--tensor-parallel-size", "4", "--seq-lens", "1024"],
        capture_output=True, text=True, check=True,
    )
    data = json.loads(out.stdout)
    assert data["tensor_parallel_size"] == 4 and data["kv_bytes_per_token"] == 80 << 10
    assert data["sequences"][0]["max_concurrency"] == 501
