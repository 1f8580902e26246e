"""bench/vs_llamacpp.py without servers: its flags, the requests every server gets, what it
reads from a llama.cpp server (or says when there is none), and the table's ratios."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from pdserve.bench import serve_load
from pdserve.bench.serve_load import RequestTiming, summarize
from pdserve.bench.vs_llamacpp import (
    LlamaCppMissing,
    describe_llamacpp,
    parse_args,
    probe_llamacpp,
    prompts_at,
    workload,
)
from pdserve.bench.vs_llamacpp_report import LLAMACPP, build_report, comparison_table, ratios

URL = "http://127.0.0.1:29650"
PROPS = {
    "build_info": "b0-0c1e57098",
    "model_ftype": "Q4_1",
    "model_path": "/tmp/models/smollm2.gguf",
    "total_slots": 64,
    "default_generation_settings": {"n_ctx": 200},
}
MODELS = {"data": [{"id": "smollm2.gguf", "meta": {"n_params": 134515008, "size": 90_177_536}}]}


def _summary(ttft: float, itl: float, tokens: int, wall: float) -> dict:
    timings = [
        RequestTiming("random", ok=True, ttft=ttft, e2e=ttft + 3 * itl, output_tokens=tokens,
                      itls=[itl] * 3)
        for _ in range(4)
    ]  # fmt: skip
    return summarize(timings, wall)


def test_defaults_are_32_in_128_out_at_concurrency_1_16_64_against_every_server():
    args = parse_args(["--llamacpp-url", URL])
    assert args.concurrency == [1, 16, 64]
    assert (args.input_len, args.output_len) == (32, 128)
    assert args.servers == [
        "colocated", "1p1d", "colocated-int8", "1p1d-int8", "colocated-int4", "1p1d-int4",
        "llamacpp",
    ]
    assert [prompts_at(args, c) for c in args.concurrency] == [8, 32, 128]
    assert prompts_at(parse_args(["--llamacpp-url", URL, "--num-prompts", "5"]), 64) == 5


def test_a_missing_llamacpp_url_says_how_to_get_a_server(capsys):
    with pytest.raises(SystemExit):
        parse_args([])
    error = capsys.readouterr().err
    assert "--llamacpp-url is missing" in error and "llama-server" in error
    assert parse_args(["--servers", "colocated,1p1d"]).llamacpp_url is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "1,x"], "expected comma-separated integers"),
        (["--concurrency", "0,4"], "expected integers of at least 1"),
        (["--concurrency", "1,16,1"], "expected each value once"),
        (
            ["--servers", "colocated,vllm"],
            (
                "choose from colocated, 1p1d, colocated-int8, 1p1d-int8, colocated-int4, "
                "1p1d-int4, llamacpp"
            ),
        ),
        (["--num-prompts", "0"], "--num-prompts is 0"),
        (["--output-len", "0"], "--output-len is 0"),
    ],
)
def test_bad_flags_name_the_value_and_what_was_expected(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--llamacpp-url", URL, *flags])
    assert message in capsys.readouterr().err


def test_quick_is_a_small_run_and_flags_parse_into_lists():
    args = parse_args(["--quick", "--llamacpp-url", URL, "--servers", "1p1d,llamacpp"])
    assert args.concurrency == [1, 4] and args.num_prompts == 4 and args.output_len == 16
    assert args.servers == ["1p1d", "llamacpp"]


def test_every_server_gets_the_same_prompts_and_each_concurrency_its_own():
    args = parse_args(["--llamacpp-url", URL, "--concurrency", "1,4"])
    vocab = list(range(100, 1000))
    first, again = workload(args, vocab), workload(args, vocab)
    assert [r.prompt for r in first[4]] == [r.prompt for r in again[4]]
    assert first[1][0].prompt != first[4][0].prompt
    assert all(len(r.prompt) == 32 and r.max_tokens == 128 for r in first[4])
    assert len(first[1]) == 8 and len(first[4]) == 8


def test_llamacpp_build_and_quantization_come_from_props_and_models():
    info = describe_llamacpp(URL, PROPS, MODELS)
    assert info["build"] == "b0-0c1e57098" and info["quantization"] == "Q4_1"
    assert info["model file"] == "smollm2.gguf" and info["parallel slots"] == "64"
    assert info["context per slot"] == "200 tokens" and info["parameters"] == "134,515,008"
    bare = describe_llamacpp(URL, None, {"data": [{"id": "m", "meta": {"ftype": "Q8_0"}}]})
    assert bare["build"] == "not reported (no /props)" and bare["quantization"] == "Q8_0"


def test_probe_reads_a_live_server_and_says_plainly_when_none_answers():
    routes = {"/health": {"status": "ok"}, "/props": PROPS, "/v1/models": MODELS}

    def live(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=routes[request.url.path])

    with httpx.Client(transport=httpx.MockTransport(live)) as client:
        assert probe_llamacpp(URL + "/", client)["quantization"] == "Q4_1"

    def dead(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(404)

    with (
        httpx.Client(transport=httpx.MockTransport(dead)) as client,
        pytest.raises(LlamaCppMissing) as missing,
    ):
        probe_llamacpp(URL, client)
    text = str(missing.value)
    assert f"no llama.cpp server answers at {URL}" in text
    assert "/health: ConnectError" in text and "/v1/models: HTTP 404" in text
    assert "does not build or start llama.cpp" in text


def test_ratios_divide_pdserve_by_llamacpp_and_skip_what_cannot_be_divided():
    ours = {"throughput_tok_s": 300.0, "ttft_p50": 0.2, "ttft_p99": 0.4, "itl_p50": 0.05,
            "itl_p99": math.nan}  # fmt: skip
    theirs = {"throughput_tok_s": 600.0, "ttft_p50": 0.1, "ttft_p99": 0.0, "itl_p50": 0.025,
              "itl_p99": 0.1}  # fmt: skip
    got = ratios(ours, theirs)
    assert got["throughput_tok_s"] == pytest.approx(0.5)
    assert got["ttft_p50"] == pytest.approx(2.0) and got["itl_p50"] == pytest.approx(2.0)
    assert math.isnan(got["ttft_p99"]) and math.isnan(got["itl_p99"])


def test_table_has_a_row_per_server_per_concurrency_with_ratios_to_llamacpp():
    results = {
        "pdserve colocated": {1: _summary(0.1, 0.02, 4, 2.0), 16: _summary(0.5, 0.04, 4, 1.0)},
        "pdserve 1P+1D": None,
        LLAMACPP: {1: _summary(0.05, 0.01, 4, 1.0), 16: _summary(0.25, 0.01, 4, 0.5)},
    }
    table = comparison_table(results, [1, 16])
    lines = table.splitlines()
    assert len(lines) == 2 + 6
    # 16 tokens in 2 s vs 1 s; TTFT 100 vs 50 ms; ITL 20 vs 10 ms
    row = "| {} | pdserve colocated | 4/4 | {} | {ttft} | {ttft} | {itl} | {itl} | 0.50x | 2.00x |"
    assert row.format(1, "8.0", ttft="100", itl="20.0") in table
    assert row.format(16, "16.0", ttft="500", itl="40.0") in table
    assert f"| 1 | {LLAMACPP} | 4/4 | 16.0 | 50.0 | 50.0 | 10.0 | 10.0 | baseline |" in table
    assert "| 16 | pdserve 1P+1D | not measured |" in table
    without = comparison_table({"pdserve colocated": results["pdserve colocated"]}, [1])
    assert without.splitlines()[-1].endswith("| n/a | n/a | n/a | n/a | n/a |")
    report = build_report("cmd", {"cpu": "x"}, {"prompts": "p"}, None, results, [1, 16], "0.5")
    assert report.startswith("# pdserve vs llama.cpp") and "llama.cpp: not measured" in report


def test_a_request_on_a_connection_the_server_had_closed_is_sent_once_more(monkeypatch):
    """llama.cpp's server closes its connection after each streamed answer, at times after the
    client sent the next request on it: that request goes again; any other failure does not."""
    calls = []

    async def stream(http, path, body, timing, failures):
        calls.append(path)
        if len(calls) <= failures:
            raise httpx.RemoteProtocolError(serve_load.STALE_CONNECTION + ".")
        timing.output_tokens = 3

    timing = RequestTiming("random", ok=False)
    monkeypatch.setattr(serve_load, "_stream", lambda *a: stream(*a, failures=1))
    asyncio.run(serve_load._send(None, "/v1/completions", {}, timing))
    assert len(calls) == 2 and timing.output_tokens == 3
    calls.clear()
    monkeypatch.setattr(serve_load, "_stream", lambda *a: stream(*a, failures=2))
    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(serve_load._send(None, "/v1/completions", {}, timing))
    assert len(calls) == 2
