"""The serving benchmark's outputs: a JSON record and a markdown report of one run. Formatting
only: every number comes in."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from pdserve.bench.report import md_table
from pdserve.bench.serve_load import RequestTiming
from pdserve.bench.serve_metrics import LATENCIES, QUANTILES

LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}


def failures(timings: list[RequestTiming]) -> dict[str, int]:
    """Each distinct failure reason with how many requests it ended, most frequent first."""
    return dict(Counter(t.error for t in timings if not t.ok).most_common())


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def record(
    command: str,
    machine: dict[str, str],
    setup: dict[str, Any],
    metrics: dict[str, float],
    timings: list[RequestTiming],
) -> dict[str, Any]:
    """The JSON result: non-finite numbers (no samples) become null."""
    return json_safe(
        {
            "command": command,
            "machine": machine,
            "setup": setup,
            "metrics": metrics,
            "failures": failures(timings),
        }
    )


def _ms(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value * 1000:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def latency_table(metrics: dict[str, Any]) -> str:
    header = ["latency (ms)", "mean", *(f"P{q}" for q in QUANTILES)]
    rows = [
        [
            LABELS[name],
            *(_ms(metrics[f"{name}_{s}"]) for s in ("mean", *(f"p{q}" for q in QUANTILES))),
        ]
        for name in LATENCIES
    ]
    return md_table(header, rows)


def throughput_table(metrics: dict[str, Any]) -> str:
    rows = [
        [
            "requests completed",
            f"{metrics['completed']}/{metrics['requests']} ({metrics['failed']} failed)",
        ],
        ["duration (s)", _num(metrics["duration_s"])],
        ["input / output tokens", f"{metrics['input_tokens']:,} / {metrics['output_tokens']:,}"],
        ["request throughput (req/s)", _num(metrics["request_throughput"], 3)],
        ["output token throughput (tok/s)", _num(metrics["throughput_tok_s"])],
        ["total token throughput (tok/s)", _num(metrics["total_throughput_tok_s"])],
        ["goodput (req/s within the SLO)", _num(metrics["goodput"], 3)],
        ["SLO attainment", f"{metrics['slo_attainment']:.1%}"],
    ]
    return md_table(["throughput", ""], rows)


def markdown(result: dict[str, Any]) -> str:
    setup = result["setup"]
    sections = [
        "# Serving benchmark",
        f"Command: `{result['command']}`",
        md_table(
            ["machine (of the load generator)", ""],
            [[k, str(v)] for k, v in result["machine"].items()],
        ),
        md_table(["setup", ""], [[k, str(v)] for k, v in setup.items()]),
        latency_table(result["metrics"]),
        throughput_table(result["metrics"]),
    ]
    if result["failures"]:
        rows = [[reason.replace("|", "/"), str(n)] for reason, n in result["failures"].items()]
        sections.append(md_table(["failure", "requests"], rows[:10]))
    sections.append(
        "TTFT: send to the first chunk with text; ITL: gaps between chunks with text; TPOT: "
        "(E2E - TTFT) / (output tokens - 1) per request; percentiles by nearest rank."
    )
    return "\n\n".join(sections) + "\n"
