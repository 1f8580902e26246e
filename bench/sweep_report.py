"""Report and plot for bench/sweep.py. Formatting only: every number comes in.

`results[config][rate]` is bench.serve_metrics.summarize's dict, or `results[config]` is None
when that configuration's server did not start.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pdserve.bench.machine import command_line, load_average
from pdserve.bench.report import md_table
from pdserve.bench.serve_options import describe_dataset

BASELINE = "colocated"


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _pair(summary: dict, metric: str, scale: float, digits: int) -> str:
    low, high = summary[f"{metric}_p50"], summary[f"{metric}_p99"]
    if not (_finite(low) and _finite(high)):
        return "n/a"
    return f"{low * scale:.{digits}f} / {high * scale:.{digits}f}"


def _higher_better(ours: float, base: float) -> str:
    if not (_finite(ours) and _finite(base)) or base == 0:
        return "n/a"
    return f"{ours / base:.2f}x"


def _lower_better(ours: float, base: float) -> str:
    if not (_finite(ours) and _finite(base)) or ours == 0 or base == 0:
        return "n/a"
    ratio = base / ours
    return f"{ratio:.2f}x better" if ratio >= 1 else f"{1 / ratio:.2f}x worse"


def baseline_name(results: dict[str, dict | None]) -> str | None:
    if results.get(BASELINE):
        return BASELINE
    return next((name for name, runs in results.items() if runs), None)


def rate_table(rate: float, results: dict[str, dict | None]) -> str:
    base_name = baseline_name(results)
    base = results[base_name][rate] if base_name else None
    header = [
        "config",
        "done",
        "goodput (req/s)",
        "TTFT P50 / P99 (s)",
        "TPOT P50 / P99 (ms)",
        "ITL P50 / P99 (ms)",
        "output tok/s",
        f"goodput vs {base_name}",
        f"P99 TTFT vs {base_name}",
        f"P99 ITL vs {base_name}",
    ]
    rows = []
    for name, runs in results.items():
        if runs is None:
            rows.append([name, "server did not start", *[""] * (len(header) - 2)])
            continue
        s = runs[rate]
        ratios = (
            ["baseline"] * 3
            if name == base_name
            else [
                _higher_better(s["goodput"], base["goodput"]),
                _lower_better(s["ttft_p99"], base["ttft_p99"]),
                _lower_better(s["itl_p99"], base["itl_p99"]),
            ]
        )
        rows.append(
            [
                name,
                f"{s['completed']}/{s['requests']}",
                f"**{s['goodput']:.3f}**",
                _pair(s, "ttft", 1, 2),
                _pair(s, "tpot", 1000, 0),
                _pair(s, "itl", 1000, 0),
                f"{s['throughput_tok_s']:.1f}",
                *ratios,
            ]
        )
    return md_table(header, rows)


def best_goodput_table(args: argparse.Namespace, results: dict[str, dict | None]) -> str:
    rows = []
    for name, runs in results.items():
        if not runs:
            continue
        rate = max(args.rates, key=lambda r: runs[r]["goodput"])
        top = runs[args.rates[-1]]["slo_attainment"]
        rows.append([name, f"{runs[rate]['goodput']:.3f}", f"{rate:g}", f"{top:.0%}"])
    header = [
        "config",
        "best goodput (req/s)",
        "at rate",
        f"SLO attainment at {args.rates[-1]:g}/s",
    ]
    return md_table(header, rows)


def build_report(
    args: argparse.Namespace,
    machine: dict[str, str],
    results: dict[str, dict | None],
    requests_by_rate: dict[float, list],
    server_flags: dict[str, list[str]],
) -> str:
    configs = [[name, f"`pdserve serve {' '.join(flags)}`"] for name, flags in server_flags.items()]
    counts = sorted({len(requests) for requests in requests_by_rate.values()})
    arrivals = f"{args.arrival} arrivals (burstiness {args.burstiness:g})"
    sections = [
        "# Request-rate sweep over serving configurations",
        f"Command: `{command_line()}`",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        md_table(["config", "server"], configs),
        (
            f"Model: {args.model or 'SmolLM2-135M-Instruct (the default model)'}. Extra server "
            f"flags: `{args.serve_flags or 'none'}`; threads per node: the launcher's default "
            "(usable cores / nodes, at least one) unless those flags say otherwise. Workload: "
            f"{describe_dataset(args)}; {', '.join(map(str, counts))} requests per rate, "
            f"{arrivals}, the same requests for every configuration at a rate and different "
            f"prompts at each rate; {args.warmup} warm-up requests per server; greedy, EOS "
            f"ignored; max concurrency {args.max_concurrency or 'unlimited'}. SLO: "
            f"{args.slo_parsed.describe()}. Goodput: completed requests per second within the "
            "SLO. TTFT to the first streamed chunk with text; ITL between such chunks."
        ),
    ]
    for rate in args.rates:
        sections += [f"## {rate:g} requests/s", rate_table(rate, results)]
    sections += ["## Best goodput", best_goodput_table(args, results)]
    sections.append(f"Load average at end: {load_average()}. Plot: `sweep.png`.")
    return "\n\n".join(sections) + "\n"


def plot(args: argparse.Namespace, results: dict[str, dict | None], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("goodput", 1, "goodput (req/s)"), ("ttft_p99", 1, "P99 TTFT (s)"))
    panels += (("itl_p99", 1000, "P99 ITL (ms)"),)
    figure, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    for (name, runs), marker in zip(results.items(), "osD^v<>"):
        if not runs:
            continue
        for axis, (key, scale, _) in zip(axes, panels):
            values = [runs[r][key] * scale for r in args.rates]
            axis.plot(args.rates, values, marker=marker, label=name)
    slo = args.slo_parsed
    if slo.ttft_s is not None:
        axes[1].axhline(slo.ttft_s, color="grey", linestyle="--", label="TTFT SLO")
    if slo.tpot_s is not None:
        axes[2].axhline(slo.tpot_s * 1000, color="grey", linestyle="--", label="TPOT SLO")
    for axis, (_, _, title) in zip(axes, panels):
        axis.set_xlabel("request rate (req/s)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
