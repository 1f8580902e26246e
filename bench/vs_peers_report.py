"""Report for bench/vs_peers.py: one table, a row per server per concurrency, each pdserve row
divided by vLLM's and by llama.cpp's at the same concurrency, in output tok/s and in output
tokens per CPU-second. Formatting and arithmetic only: every number comes in.

`results[server][concurrency]` is bench.serve_metrics.summarize's dict (latencies in seconds)
plus `cpu_s` and `tok_per_cpu_s`, or `results[server]` is None when it was not measured.
"""

from __future__ import annotations

from pdserve.bench.report import md_table
from pdserve.bench.vs_llamacpp_report import number_cell, ratio, ratio_cell

VLLM = "vLLM"
LLAMACPP = "llama.cpp"
PEERS = (VLLM, LLAMACPP)
#: (summary key, column title, scale to the unit in the title)
METRICS = (
    ("throughput_tok_s", "output tok/s", 1.0),
    ("tok_per_cpu_s", "tok per CPU-s", 1.0),
    ("ttft_p50", "TTFT P50 (ms)", 1000.0),
    ("itl_p50", "ITL P50 (ms)", 1000.0),
    ("itl_p99", "ITL P99 (ms)", 1000.0),
)
#: the two figures every pdserve row is divided by each peer's
RATIO_KEYS = (("throughput_tok_s", "tok/s"), ("tok_per_cpu_s", "tok/CPU-s"))


def cores_busy(summary: dict) -> str:
    """CPU seconds per wall second during the wave: how many cores the server kept busy."""
    return number_cell(ratio(summary.get("cpu_s"), summary.get("duration_s")), 1.0)


def comparison_table(results: dict[str, dict | None], concurrencies: list[int]) -> str:
    """Rows grouped by concurrency; the last four columns are pdserve / each peer."""
    header = ["concurrency", "server", "done", *(t for _, t, _ in METRICS), "cores busy"]
    header += [f"{title} ÷ {peer}" for peer in PEERS for _, title in RATIO_KEYS]
    rows = []
    for concurrency in concurrencies:
        bases = {peer: (results.get(peer) or {}).get(concurrency) for peer in PEERS}
        for server, runs in results.items():
            summary = (runs or {}).get(concurrency)
            if summary is None:
                rows.append([str(concurrency), server, "not measured", *[""] * (len(header) - 3)])
                continue
            cells = [number_cell(summary.get(key), scale) for key, _, scale in METRICS]
            quotients = []
            for peer in PEERS:
                base = bases[peer]
                for key, _ in RATIO_KEYS:
                    if server == peer:
                        quotients.append("baseline")
                    elif server in PEERS or base is None:
                        quotients.append("")
                    else:
                        quotients.append(ratio_cell(ratio(summary.get(key), base.get(key))))
            done = f"{summary['completed']}/{summary['requests']}"
            rows.append([str(concurrency), server, done, *cells, cores_busy(summary), *quotients])
    return md_table(header, rows)


def build_report(
    command: str,
    machine: dict[str, str],
    setup: dict[str, str],
    results: dict[str, dict | None],
    concurrencies: list[int],
    load_at_end: str,
) -> str:
    sections = [
        "# pdserve vs vLLM's CPU build and llama.cpp's server, same model, same prompts",
        f"Command: `{command}`",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        md_table(["setup", ""], [[k, v] for k, v in setup.items()]),
        "## Results",
        comparison_table(results, concurrencies),
        (
            "Ratios are pdserve / the peer at the same concurrency; above 1x is better. tok per "
            "CPU-s: output tokens / CPU seconds of every process of the server during the wave "
            "(a server that spins idle threads pays for them). TTFT: send to the first streamed "
            "chunk with text; ITL: gaps between such chunks (bench/serve_metrics.py); output "
            "tok/s: completed output tokens / wall time from the first send to the last answer."
        ),
        f"Load average at end: {load_at_end}.",
    ]
    return "\n\n".join(sections) + "\n"
