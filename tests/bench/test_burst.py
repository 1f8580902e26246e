"""The burst benchmark: each stream's outcome from what it saw, the summary's counts and
percentiles, the report, the client against canned answers, and one small burst against a real
`pdserve serve` on the tiny model in which every request is counted exactly once."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest

from pdserve.bench.burst import completion_body, main, parse_args, send_burst
from pdserve.bench.burst_report import markdown
from pdserve.bench.burst_streams import Outcome, StreamRecord, absorb_event, classify, summarize
from pdserve.bench.server_processes import process_label

MAX_TOKENS = 4


def _chunk(text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


def _usage(tokens: int) -> str:
    return json.dumps({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": tokens}})


def _error(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "service_unavailable_error"}})


def _streamed(*payloads: str, status: int = 200, **fields) -> StreamRecord:
    record = StreamRecord(status=status, **fields)
    for index, payload in enumerate(payloads):
        absorb_event(record, payload, 0.5 + index * 0.1)
    return record


def _full_stream() -> list[str]:
    texts = [_chunk("a"), _chunk("b"), _chunk("c"), _chunk("d", "length")]
    return [*texts, _usage(MAX_TOKENS), "[DONE]"]


def test_a_full_stream_is_read_into_tokens_first_token_time_and_finish_reason():
    record = _streamed(*_full_stream())
    assert (record.text_chunks, record.usage_tokens, record.tokens) == (4, 4, 4)
    assert record.first_token_s == 0.5 and record.finish_reason == "length"
    assert record.error_event == ""
    assert classify(record, MAX_TOKENS) == (Outcome.COMPLETED, "")


def test_the_usage_count_wins_over_text_chunks_and_a_finish_chunk_may_be_empty():
    record = _streamed(_chunk("ab"), _chunk("", "length"), _usage(MAX_TOKENS))
    assert record.text_chunks == 1 and record.tokens == MAX_TOKENS
    assert classify(record, MAX_TOKENS)[0] is Outcome.COMPLETED


@pytest.mark.parametrize(
    ("record", "outcome", "detail"),
    [
        (StreamRecord(status=429, end_s=0.01), Outcome.REFUSED, "HTTP 429"),
        (StreamRecord(status=503, end_s=0.01), Outcome.REFUSED, "HTTP 503"),
        (_streamed(_error("no node"), "[DONE]"), Outcome.REFUSED, "error event"),
        (
            _streamed(_chunk("a"), _error("node died"), "[DONE]"),
            Outcome.DIED,
            "error event after 1 tokens: node died",
        ),
        (
            _streamed(_chunk("a"), _chunk("b"), exception="RemoteProtocolError: cut"),
            Outcome.DIED,
            "the stream broke after 2 tokens: RemoteProtocolError: cut",
        ),
        (
            _streamed(_chunk("a"), "[DONE]"),
            Outcome.DIED,
            "1 of 4 tokens and no finish_reason",
        ),
        (
            _streamed(_chunk("a"), timed_out=True),
            Outcome.TIMED_OUT,
            "after 1 tokens",
        ),
        (StreamRecord(timed_out=True), Outcome.TIMED_OUT, "after 0 tokens"),
        (
            StreamRecord(exception="ConnectError: refused"),
            Outcome.FAILED,
            "no answer: ConnectError: refused",
        ),
        (StreamRecord(status=400, body="too long"), Outcome.FAILED, "HTTP 400: too long"),
        (
            _streamed(exception="ReadError: reset"),
            Outcome.FAILED,
            "the stream broke before a token: ReadError: reset",
        ),
        (_streamed("[DONE]"), Outcome.FAILED, "the stream ended without a token"),
        (
            _streamed(_chunk("a", "stop"), _usage(1)),
            Outcome.FAILED,
            "finish_reason 'stop' after 1 tokens",
        ),
    ],
)
def test_each_stream_gets_exactly_one_outcome_and_its_reason(record, outcome, detail):
    assert classify(record, MAX_TOKENS) == (outcome, detail)


def test_summary_counts_add_up_and_percentiles_take_the_nearest_rank():
    completed = [
        _streamed(*_full_stream(), sent_s=0.1, end_s=1.0 + i) for i in range(3)
    ]  # TTFT 0.4 s each
    completed[2].first_token_s = 2.1  # TTFT 2.0 s
    refused = [StreamRecord(status=429, sent_s=0.0, end_s=t) for t in (0.02, 0.03, 0.2)]
    died = _streamed(_chunk("a"), _error("gone"), sent_s=0.0, end_s=9.5)
    timed_out = StreamRecord(timed_out=True, sent_s=0.0, end_s=5.0, written_s=0.05)
    summary = summarize([*completed, *refused, died, timed_out], MAX_TOKENS)
    assert summary["requests"] == 8
    counts = {outcome.name.lower(): summary[outcome.name.lower()] for outcome in Outcome}
    assert counts == {"completed": 3, "refused": 3, "died": 1, "timed_out": 1, "failed": 0}
    assert sum(counts.values()) == summary["requests"]
    assert summary["refused_by"] == {"HTTP 429": 3}
    assert summary["ttft_p50"] == pytest.approx(0.4) and summary["ttft_p99"] == pytest.approx(2.0)
    assert summary["refusal_p50"] == 0.03 and summary["refusal_p99"] == 0.2
    assert summary["drain_s"] == 9.5 and summary["last_written_s"] == 0.05
    assert summary["not_completed"] == {
        "refused: HTTP 429": 3,
        "died after a token: error event after 1 tokens: gone": 1,
        "timed out: after 0 tokens": 1,
    }


def test_an_empty_burst_summarizes_to_no_samples():
    summary = summarize([], MAX_TOKENS)
    assert summary["requests"] == 0 and summary["completed"] == 0
    assert math.isnan(summary["ttft_p50"]) and math.isnan(summary["drain_s"])


def _result(died: int) -> dict:
    memory = {
        "router": {"before": 300 * 1024, "peak": 340 * 1024, "hwm": 350 * 1024},
        "colocated-0": {"before": 900 * 1024, "peak": 1000 * 1024, "hwm": 1000 * 1024},
    }
    summary = {
        **summarize([_streamed(*_full_stream(), end_s=1.0)] * 2, MAX_TOKENS),
        "client_cpu_s": 0.4,
        "memory_kib": memory,
        "replaced_processes": [],
    }
    slower = {**summary, "drain_s": 2.0, "died": died}
    slower["memory_kib"] = {"router": memory["router"], "decode-0": memory["colocated-0"]}
    return {
        "command": "python -m pdserve.bench.burst --bursts 2",
        "machine": {"cores": "2 usable (2 online)"},
        "setup": {"prompts": "140 random token ids"},
        "deployments": {
            "colocated": {"flags": ["--colocated"], "bursts": {"2": summary}},
            "1p1d": {"flags": ["--prefill", "1", "--decode", "1"], "bursts": {"2": slower}},
            "2p1d": {"flags": ["--prefill", "2"], "bursts": {}, "error": "did not start"},
        },
    }


def assert_report_has(text: str, *expected: str) -> None:
    missing = [part for part in expected if part not in text]
    assert not missing, f"not in the report: {missing}\n{text}"


def test_report_has_a_row_per_deployment_and_burst_memory_columns_and_ratios():
    assert_report_has(
        markdown(_result(died=0)),
        "Command: `python -m pdserve.bench.burst --bursts 2`",
        "| colocated | 2 | 2/2 | 0 (0 / 0 / 0) | 0 | 0 | 0 | 0.50 / 0.50 |",
        "| 2p1d | - | not run: did not start |",
        "| deployment | burst | router | colocated-0 | decode-0 |",
        "| colocated | 2 | 340 (+40) | 1000 (+100) | - |",
        "| 1p1d / colocated | 2 | 2 vs 2 | 2.00x |",
        "Died after a token: 0 in every run.",
        "- 2p1d: did not start",
    )


def test_report_marks_requests_that_died_after_a_token():
    text = markdown(_result(died=1))
    assert "| **1 (must be 0)** |" in text
    assert "**Died after a token: 1 requests (must be 0); see below.**" in text


def test_loaded_host_rows_are_labelled_explained_and_compared_with_their_idle_run():
    result = _result(died=0)
    idle = result["deployments"]["1p1d"]
    idle.update(deployment="1p1d", loaded_host=False, busy_processes=0)
    idle["load_average"] = {"before bursts": "0.50", "after bursts": "0.70"}
    slower = {**idle["bursts"]["2"], "drain_s": 3.0}
    result["deployments"]["1p1d (loaded host)"] = {
        **idle,
        "loaded_host": True,
        "busy_processes": 2,
        "load_average": {"before bursts": "0.60", "after bursts": "2.90"},
        "bursts": {"2": slower},
    }
    assert_report_has(
        markdown(result),
        "| 1p1d (loaded host) | `pdserve serve --prefill 1 --decode 1` | loaded: 2 ",
        "| 1p1d | `pdserve serve --prefill 1 --decode 1` | idle | 0.50 / 0.70 |",
        "one busy-looping Python process per usable core",
        "at normal priority",
        "| 1p1d (loaded host) | 2 | 2/2 |",
        "| 1p1d (loaded host) / 1p1d | 2 | 2 vs 2 | 1.50x |",
        "| 1p1d / colocated | 2 | 2 vs 2 | 2.00x |",
    )
    assert "Loaded host:" not in markdown(_result(died=0))


def test_the_client_floor_sits_beside_the_refusals_of_the_deployments_on_its_host():
    result = _result(died=0)
    refusing = {**result["deployments"]["1p1d"]["bursts"]["2"], "refusal_p99": 3.5}
    result["deployments"]["1p1d"].update(loaded_host=False, bursts={"2": refusing})
    floor = {"refused": 2, "refusal_p50": 1.25, "refusal_p99": 1.5, "last_written_s": 0.02,
             "client_cpu_s": 0.3}
    result["client_floor"] = {"idle": {"2": floor}, "loaded": {"error": "did not start"}}
    assert_report_has(
        markdown(result),
        "## Client floor",
        "| idle | 2 | 2/2 | 1.25 / 1.50 | 20 | 0.3 | 1p1d: 3.50 |",
        "| loaded | - | not run: did not start |",
    )
    assert "## Client floor" not in markdown(_result(died=0))


def test_process_labels_name_the_router_and_each_node_without_the_port_suffix():
    assert process_label(["python", "-m", "pdserve.router", "--port", "8000"]) == "router"
    node = ["python", "-m", "pdserve.node", "prefill", "--node-id", "prefill-0.21300", "--listen", "x"]
    assert process_label(node) == "prefill-0"
    config = '{"node": {"node_id": "decode-1.21300"}, "engine": {}}'  # as `pdserve serve` hands it
    assert process_label(["python", "-m", "pdserve.node", "decode"], config) == "decode-1"


def test_bad_flags_are_refused_with_the_value(capsys):
    for argv in (["--bursts", "100,0"], ["--deployments", "colocated,4p4d"], ["--timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "4p4d" in capsys.readouterr().err
    args = parse_args(["--server-arg=--max-queued-requests=8", "--bursts", "8"])
    assert args.server_arg == ["--max-queued-requests=8"] and args.bursts == [8]
    assert args.loaded_host == "no"
    assert parse_args(["--loaded-host", "also"]).loaded_host == "also"
    with pytest.raises(SystemExit):
        parse_args(["--loaded-host", "yes"])


def test_the_client_records_every_kind_of_answer_once_in_request_order():
    """Canned answers by prompt, from a real HTTP server: a full stream, a 429, an error event
    after a token, a stream cut mid-way, and one too slow for the timeout."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        kind = (await request.json())["prompt"][0]
        if kind == 1:
            return web.json_response({"error": {"message": "queue full"}}, status=429)
        if kind == 4:
            await asyncio.Event().wait()  # never answers; cancelled at the server's cleanup
        stream = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await stream.prepare(request)
        if kind == 0:
            await stream.write("".join(f"data: {p}\n\n" for p in _full_stream()).encode())
        elif kind == 2:
            events = f"data: {_chunk('a')}\n\ndata: {_error('node lost')}\n\ndata: [DONE]\n\n"
            await stream.write(events.encode())
        else:  # 3: a token, then the connection is cut before the chunked body ends
            await stream.write(f"data: {_chunk('a')}\n\n".encode())
            request.transport.close()
            return stream
        await stream.write_eof()
        return stream

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return await send_burst(f"http://127.0.0.1:{port}", bodies, 0.5)
        finally:
            await runner.cleanup()

    bodies = [completion_body("m", [kind, 7], MAX_TOKENS) for kind in (0, 1, 2, 3, 4, 0)]
    records, _ = asyncio.run(scenario())
    outcomes = [classify(record, MAX_TOKENS)[0] for record in records]
    assert outcomes == [
        Outcome.COMPLETED,
        Outcome.REFUSED,
        Outcome.DIED,
        Outcome.DIED,
        Outcome.TIMED_OUT,
        Outcome.COMPLETED,
    ]
    assert "Payload" in records[3].exception  # the body ended before its last chunk
    assert 0.5 <= records[4].end_s < 2.0
    assert all(record.written_s is not None for record in records)


def test_a_burst_against_a_real_server_counts_every_request_exactly_once(tiny_llama_dir, tmp_path):
    """PDSERVE_TEST_PORT pins the router's port (default: a free one)."""
    port = os.environ.get("PDSERVE_TEST_PORT")
    argv = ["--model", str(tiny_llama_dir), "--deployments", "colocated", "--bursts", "8"]
    argv += ["--prompt-len", "40", "--max-tokens", str(MAX_TOKENS), "--timeout", "60"]
    argv += ["--server-arg=--threads-per-node=1", f"--server-arg=--kv-cache-memory={16 << 20}"]
    argv += ["--out-dir", str(tmp_path), *(["--port", port] if port else [])]
    assert main(argv) == 0
    result = json.loads((tmp_path / "burst.json").read_text())
    summary = result["deployments"]["colocated"]["bursts"]["8"]
    counts = [summary[outcome.name.lower()] for outcome in Outcome]
    assert sum(counts) == summary["requests"] == 8
    assert summary["completed"] == 8 and summary["died"] == 0
    assert 0 < summary["ttft_p50"] <= summary["ttft_p99"] <= summary["drain_s"]
    assert {"router", "colocated-0"} <= set(summary["memory_kib"])
    assert summary["memory_kib"]["colocated-0"]["peak"] > 0
    report = (tmp_path / "burst.md").read_text()
    assert "| colocated | 8 | 8/8 |" in report
    floor = result["client_floor"]["idle"]["8"]  # the same burst, refused at once
    assert floor["refused"] == 8 and 0 < floor["refusal_p50"] <= floor["refusal_p99"]
    assert "| idle | 8 | 8/8 |" in report
