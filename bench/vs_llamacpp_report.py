"""Report for bench/vs_llamacpp.py: one table, a row per server per concurrency, with pdserve's
numbers divided by llama.cpp's at the same concurrency. Formatting and arithmetic only: every
number comes in.

`results[server][concurrency]` is bench.serve_metrics.summarize's dict (latencies in seconds),
or `results[server]` is None when that server could not be measured.
"""

from __future__ import annotations

import math

from pdserve.bench.report import md_table

LLAMACPP = "llama.cpp"
#: (summary key, column title, scale to the unit in the title)
METRICS = (
    ("throughput_tok_s", "output tok/s", 1.0),
    ("ttft_p50", "TTFT P50 (ms)", 1000.0),
    ("ttft_p99", "TTFT P99 (ms)", 1000.0),
    ("itl_p50", "ITL P50 (ms)", 1000.0),
    ("itl_p99", "ITL P99 (ms)", 1000.0),
)
RATIO_TITLES = ("tok/s", "TTFT P50", "TTFT P99", "ITL P50", "ITL P99")


def ratio(ours: float | None, theirs: float | None) -> float:
    """ours / theirs, NaN when either is missing, not finite, or theirs is 0."""
    if ours is None or theirs is None or not (math.isfinite(ours) and math.isfinite(theirs)):
        return math.nan
    return ours / theirs if theirs != 0 else math.nan


def ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """pdserve / llama.cpp for every metric of the table, keyed like the summaries."""
    return {key: ratio(ours.get(key), theirs.get(key)) for key, _, _ in METRICS}


def number_cell(value: float | None, scale: float) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    scaled = value * scale
    return f"{scaled:,.0f}" if abs(scaled) >= 100 else f"{scaled:.1f}"


def ratio_cell(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.2f}x"


def comparison_table(results: dict[str, dict | None], concurrencies: list[int]) -> str:
    """Rows grouped by concurrency; the last five columns are pdserve / llama.cpp."""
    header = ["concurrency", "server", "done"] + [title for _, title, _ in METRICS]
    header += [f"{title} / llama.cpp" for title in RATIO_TITLES]
    rows = []
    for concurrency in concurrencies:
        base_runs = results.get(LLAMACPP)
        base = base_runs.get(concurrency) if base_runs else None
        for server, runs in results.items():
            summary = runs.get(concurrency) if runs else None
            if summary is None:
                rows.append([str(concurrency), server, "not measured", *[""] * (len(header) - 3)])
                continue
            cells = [number_cell(summary[key], scale) for key, _, scale in METRICS]
            if server == LLAMACPP:
                quotients = ["baseline"] * len(METRICS)
            elif base is None:
                quotients = ["n/a"] * len(METRICS)
            else:
                quotients = [ratio_cell(v) for v in ratios(summary, base).values()]
            done = f"{summary['completed']}/{summary['requests']}"
            rows.append([str(concurrency), server, done, *cells, *quotients])
    return md_table(header, rows)


def llamacpp_table(info: dict[str, str] | None) -> str:
    if not info:
        return "llama.cpp: not measured (no `--llamacpp-url`, or llamacpp left out of --servers)."
    return md_table(["llama.cpp server", ""], [[key, str(value)] for key, value in info.items()])


def build_report(
    command: str,
    machine: dict[str, str],
    setup: dict[str, str],
    llamacpp: dict[str, str] | None,
    results: dict[str, dict | None],
    concurrencies: list[int],
    load_at_end: str,
) -> str:
    sections = [
        "# pdserve vs llama.cpp's server, same model, same prompts",
        f"Command: `{command}`",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        llamacpp_table(llamacpp),
        md_table(["setup", ""], [[k, v] for k, v in setup.items()]),
        "## Results",
        comparison_table(results, concurrencies),
        (
            "Ratios are pdserve / llama.cpp at the same concurrency: above 1x is better for "
            "output tok/s, below 1x is better for TTFT and ITL. TTFT: send to the first "
            "streamed chunk with text; ITL: gaps between such chunks (bench/serve_metrics.py); "
            "output tok/s: completed output tokens / wall time from the first send to the last "
            "answer."
        ),
        f"Load average at end: {load_at_end}.",
    ]
    return "\n\n".join(sections) + "\n"
