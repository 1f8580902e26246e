"""The router's logs for operators: the access line per request and `x-request-id`, the JSON
format, the periodic stats line per node (driven with NodeStats and a fake clock), and the
flags that set them (vLLM's spellings)."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from pdserve.router.__main__ import parse_args
from pdserve.router.api.access_log import request_id_from
from pdserve.router.api.app import create_app
from pdserve.router.cluster.stats_log import StatsLog
from pdserve.router.config import RouterConfig
from pdserve.wire.log_format import JSONFormatter, LogSettings
from pdserve.wire.messages import NodeStats
from tests.node_stats import node_stats
from tests.router.test_streaming import MODEL, run_with_node
from tests.router.unlooped import unlooped_router_config

ACCESS_LOGGER = "pdserve.router.api.access_log"
STATS_LOGGER = "pdserve.router.cluster.stats_log"


def access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


def complete(tmp_path, tokenizer, headers: dict[str, str], **body):
    async def scenario(http, node):
        request = {"model": MODEL, "prompt": "a", "max_tokens": 3, **body}
        return await http.post("/v1/completions", json=request, headers=headers)

    return run_with_node(tmp_path, tokenizer, scenario)


def test_access_line_names_the_request_its_tokens_and_timings(tmp_path, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    response = complete(tmp_path, tokenizer, {"x-request-id": "trace-42:a/b"}, n=2, seed=1)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-42:a/b"
    [record] = access_records(caplog)
    fields = record.fields
    usage = response.json()["usage"]
    assert fields["request_id"] == "trace-42:a/b"
    assert fields["response_id"] == response.json()["id"] != "trace-42:a/b"
    assert (fields["method"], fields["route"], fields["status"]) == ("POST", "/v1/completions", 200)
    assert fields["prompt_tokens"] == usage["prompt_tokens"]
    assert fields["generation_tokens"] == usage["completion_tokens"] == 6
    assert fields["cached_tokens"] == 0
    assert fields["finish_reasons"] == ["length"]
    assert 0 < fields["ttft_s"] <= fields["e2e_s"]
    message = record.getMessage()
    assert record.levelno == logging.INFO
    assert "request_id=trace-42:a/b " in message and "finish_reasons=length" in message


def test_streamed_request_is_logged_once_after_its_stream(tmp_path, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    response = complete(tmp_path, tokenizer, {}, stream=True)
    assert response.text.endswith("data: [DONE]\n\n")
    [record] = access_records(caplog)
    assert record.fields["request_id"] == response.headers["x-request-id"]
    assert record.fields["generation_tokens"] == 3 and record.fields["status"] == 200


@pytest.mark.parametrize(
    "header", ["", "x" * 129, "has space", "new\nline", "quote\"", "ünï", "a;b", "<script>"]
)
def test_an_invalid_request_id_is_replaced_never_echoed(header):
    replaced = request_id_from([(b"x-request-id", header.encode("utf-8"))])
    assert replaced != header and len(replaced) == 32
    int(replaced, 16)


def test_request_id_is_bounded_to_128_safe_characters():
    longest = "A-z.0_9:@/+=" * 10 + "12345678"
    assert len(longest) == 128
    assert request_id_from([(b"X-Request-Id", longest.encode())]) == longest


@pytest.fixture(scope="module")
def app_factory(tiny_llama_dir):
    def make(**settings):
        config = unlooped_router_config(
            tiny_llama_dir,
            MODEL,
            **settings,
        )
        return TestClient(create_app(config))

    return make


def test_every_route_answers_the_request_id_and_errors_are_logged(app_factory, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client = app_factory()
    sent = client.get("/v1/models", headers={"x-request-id": "abc"})
    fresh = client.get("/v1/models/other", headers={"x-request-id": "bad id"})
    assert sent.headers["x-request-id"] == "abc"
    assert fresh.status_code == 404 and len(fresh.headers["x-request-id"]) == 32
    statuses = [(r.fields["request_id"], r.fields["status"]) for r in access_records(caplog)]
    # no node has joined: the model routes answer 503 until one can serve
    assert statuses == [("abc", 503), (fresh.headers["x-request-id"], 404)]


def test_probes_and_scrapes_get_no_access_line(app_factory, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client = app_factory()
    assert client.get("/health").headers["x-request-id"]
    client.get("/metrics")
    assert access_records(caplog) == []


def test_disable_log_requests_turns_the_lines_off_not_the_header(app_factory, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client = app_factory(log_requests=False)
    assert client.get("/v1/models", headers={"x-request-id": "abc"}).headers["x-request-id"] == "abc"
    assert access_records(caplog) == []


def test_json_lines_carry_ts_level_logger_message_and_the_access_fields():
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, "%s", ("line",), None)
    record.fields = {"request_id": "abc", "status": 200, "finish_reasons": ["stop"]}
    line = json.loads(JSONFormatter().format(record))
    assert set(line) == {"ts", "level", "logger", "message", "request_id", "status",
                         "finish_reasons"}
    assert (line["level"], line["logger"], line["message"]) == ("INFO", ACCESS_LOGGER, "line")
    assert line["ts"].endswith("+00:00") and line["finish_reasons"] == ["stop"]


def test_json_lines_keep_a_traceback_and_escape_newlines():
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", ("a\nb",),
                                   sys.exc_info())
    text = JSONFormatter().format(record)
    assert "\n" not in text
    line = json.loads(text)
    assert line["message"] == "failed: a\nb" and "ValueError" in line["exception"]


def test_text_lines_escape_control_characters_a_client_may_send():
    """A client's string in a message (a grammar error names the spec) starts no forged line."""
    try:
        raise ValueError("bad")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "x", logging.WARNING, __file__, 1, "spec %s refused",
            ('{"type": "nonsense\n2026-01-01 00:00:00 INFO forged: line\r\x1b[2K"}',),
            sys.exc_info(),
        )
    message_line, *traceback_lines = LogSettings().formatter().format(record).split("\n")
    assert message_line.endswith(
        'spec {"type": "nonsense\\n2026-01-01 00:00:00 INFO forged: line\\r\\x1b[2K"} refused'
    )
    assert traceback_lines[0] == "Traceback (most recent call last):"  # still readable


def test_router_flags_use_vllm_spellings():
    base = ["--model", "m", "--node", "tcp://127.0.0.1:1", "--listen", "tcp://127.0.0.1:2"]
    config, log = parse_args(base)
    assert config.log_requests and config.log_stats
    assert log == LogSettings("info", "text", "warning")
    config, log = parse_args([*base, "--disable-log-requests", "--disable-log-stats",
                              "--log-format", "json", "--log-level", "DEBUG",
                              "--uvicorn-log-level", "info"])
    assert not config.log_requests and not config.log_stats
    assert log == LogSettings("debug", "json", "info")
    assert isinstance(log.formatter(), JSONFormatter)
    with pytest.raises(SystemExit):
        parse_args([*base, "--log-format", "xml"])


def test_log_requests_has_both_of_vllms_spellings_and_refuses_both_at_once(capsys):
    base = ["--model", "m", "--node", "tcp://127.0.0.1:1", "--listen", "tcp://127.0.0.1:2"]
    assert parse_args([*base, "--enable-log-requests"], environ={})[0].log_requests is True
    assert parse_args([*base, "--disable-log-requests"], environ={})[0].log_requests is False
    with pytest.raises(SystemExit):
        parse_args([*base, "--enable-log-requests", "--disable-log-requests"], environ={})
    err = capsys.readouterr().err
    assert "--disable-log-requests: not allowed with argument --enable-log-requests" in err


def test_log_settings_refuse_unknown_values():
    with pytest.raises(ValueError, match="log_format is 'xml'"):
        LogSettings(log_format="xml")
    with pytest.raises(ValueError, match="uvicorn_level is 'loud'"):
        LogSettings(uvicorn_level="loud")


# -- the periodic stats line -------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(node: str = "p0", role: str = "prefill", **fields) -> NodeStats:
    return node_stats(node_id=node, role=role, num_free_blocks=75, num_total_blocks=100, **fields)


def test_stats_line_every_interval_with_rates_usage_and_hit_rate(caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    clock = FakeClock()
    log = StatsLog(5.0, clock)
    assert log.observe("p0", stats()) == []
    clock.now += 4.9
    busy = stats(num_running=3, num_waiting=2, prompt_tokens_computed_total=1000,
                 generation_total=50, prefix_cache_queries_total=400,
                 prefix_cache_hits_total=100)
    assert log.observe("p0", busy) == []
    clock.now += 0.1
    [fields] = log.observe("p0", busy)
    assert fields == {
        "node": "p0", "role": "prefill", "prompt_tokens_per_s": 200.0,
        "generation_tokens_per_s": 10.0, "running": 3, "waiting": 2, "kv_cache_usage": 0.25,
        "prefix_cache_hit_rate": 0.25,
    }
    [record] = [r for r in caplog.records if r.name == STATS_LOGGER]
    assert record.levelno == logging.INFO and record.fields == fields
    assert record.getMessage() == (
        "node p0 (prefill): Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: "
        "10.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 25.0%"
    )


def test_stats_line_only_for_nodes_with_traffic_since_the_last_line():
    clock = FakeClock()
    log = StatsLog(5.0, clock)
    log.observe("p0", stats())
    log.observe("d0", stats("d0", "decode"))
    clock.now += 5
    assert log.observe("p0", stats()) == []  # nothing happened anywhere
    clock.now += 5
    [fields] = log.observe("d0", stats("d0", "decode", num_running=1))
    assert fields["node"] == "d0"
    clock.now += 5
    lines = log.observe("p0", stats(generation_total=20))
    assert [f["node"] for f in lines] == ["p0", "d0"]
    clock.now += 5
    lines = log.observe("p0", stats(generation_total=20))
    assert [f["node"] for f in lines] == ["d0"]  # d0 still runs a request; p0 is idle
    clock.now += 5
    log.forget("d0")
    assert log.observe("p0", stats(generation_total=20)) == []


def test_stats_line_of_a_restarted_node_counts_from_zero():
    clock = FakeClock()
    log = StatsLog(5.0, clock)
    log.observe("p0", stats(generation_total=1000))
    clock.now += 5
    [fields] = log.observe("p0", stats(generation_total=50))
    assert fields["generation_tokens_per_s"] == 10.0


def test_disable_log_stats_builds_no_stats_log(app_factory):
    assert app_factory(log_stats=False).app.state.router.stats_log is None
    assert app_factory().app.state.router.stats_log.interval_s == 10.0  # vLLM's interval


def test_router_config_refuses_a_bad_stats_interval(tiny_llama_dir):
    with pytest.raises(ValueError, match="stats_log_interval_s is 0"):
        RouterConfig(model_path=tiny_llama_dir, stats_log_interval_s=0)
