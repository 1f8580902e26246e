"""The serving benchmark against a real `pdserve serve` on the tiny model: every request
completes with the asked-for tokens, the JSON result holds sane metrics, a failing request is
recorded instead of ending the run, and `pdserve bench serve --help` works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.serve import main
from pdserve.bench.serve_load import LoadOptions, LoadRequest, run_load, summarize

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    from pdserve.commands.serve_process import ServeProcess

    flags = ["--model", str(tiny_llama_dir), "--colocated", "--threads-per-node", "1"]
    server = ServeProcess([*flags, "--kv-cache-memory", str(16 << 20)], ready_timeout_s=180)
    try:
        yield server.url
    finally:
        server.close()


def test_short_load_run_completes_every_request_and_writes_sane_metrics(
    tiny_server, tiny_llama_dir, tmp_path
):
    result_json, result_md = tmp_path / "result.json", tmp_path / "result.md"
    code = main(
        [
            *("--base-url", tiny_server, "--tokenizer", str(tiny_llama_dir)),
            *("--dataset", "random", "--input-len", "32", "--output-len", "4"),
            *("--num-prompts", "6", "--max-concurrency", "2", "--request-rate", "50"),
            *("--warmup", "1", "--no-progress", "--slo", "ttft:60000,tpot:60000"),
            *("--result-json", str(result_json), "--result-md", str(result_md)),
        ]
    )
    assert code == 0
    result = json.loads(result_json.read_text())
    metrics = result["metrics"]
    assert (metrics["requests"], metrics["completed"], metrics["failed"]) == (6, 6, 0)
    assert metrics["output_tokens"] == 6 * 4 and metrics["input_tokens"] == 6 * 32
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert metrics[f"{name}_mean"] > 0
        assert metrics[f"{name}_p50"] <= metrics[f"{name}_p90"] <= metrics[f"{name}_p99"]
    assert metrics["ttft_p99"] <= metrics["e2e_p99"]
    assert metrics["request_throughput"] > 0 and metrics["throughput_tok_s"] > 0
    assert metrics["total_throughput_tok_s"] > metrics["throughput_tok_s"]
    assert metrics["goodput"] == metrics["request_throughput"]  # a one-minute SLO holds
    assert metrics["slo_attainment"] == 1.0
    assert result["failures"] == {} and "cores" in result["machine"]
    assert "--max-concurrency 2" in result["command"]
    assert "| TTFT |" in result_md.read_text()


def test_chat_endpoint_streams_text_prompts(tiny_server, tiny_llama_dir, tmp_path):
    result_json = tmp_path / "chat.json"
    argv = ["--base-url", tiny_server, "--tokenizer", str(tiny_llama_dir), "--endpoint", "chat"]
    argv += ["--dataset", "chat", "--chat-input-max", "40", "--chat-output-max", "5"]
    argv += ["--num-prompts", "2", "--warmup", "0", "--no-progress"]
    assert main([*argv, "--result-json", str(result_json)]) == 0
    metrics = json.loads(result_json.read_text())["metrics"]
    assert metrics["completed"] == 2 and metrics["ttft_p50"] > 0


def test_a_rejected_request_is_counted_as_failed_not_raised(tiny_server):
    requests = [
        LoadRequest(0.0, [10] * 8, 3, "ok"),
        LoadRequest(0.0, [10] * 8, 5000, "too long"),  # beyond the tiny model's context
    ]
    timings, wall = run_load(tiny_server, requests, LoadOptions(max_concurrency=1))
    assert [t.ok for t in timings] == [True, False]
    assert timings[0].output_tokens == 3
    assert timings[1].error.startswith("HTTP 400")
    metrics = summarize(timings, wall)
    assert (metrics["completed"], metrics["failed"]) == (1, 1)


def test_pdserve_bench_serve_help_lists_the_benchmark_flags():
    help_text = subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "bench", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert help_text.startswith("usage: pdserve bench serve")
    for flag in ("--request-rate", "--burstiness", "--slo", "--dataset", "--result-json"):
        assert flag in help_text
