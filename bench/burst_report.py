"""The burst benchmark's report (bench/burst.py): markdown tables from its JSON record,
formatting only."""

from __future__ import annotations

import math

from pdserve.bench.report import md_table


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _pair(summary: dict, name: str) -> str:
    low, high = summary[f"{name}_p50"], summary[f"{name}_p99"]
    return f"{low:.2f} / {high:.2f}" if _finite(low) and _finite(high) else "n/a"


def _ratio(ours: float | None, base: float | None) -> str:
    return f"{ours / base:.2f}x" if _finite(ours) and _finite(base) and base else "n/a"


def outcome_table(deployments: dict) -> str:
    header = [
        "deployment",
        "burst",
        "completed",
        "refused (429 / 503 / error event)",
        "died after a token",
        "timed out",
        "failed",
        "TTFT P50 / P99 (s)",
        "refusal P50 / P99 (s)",
        "drain (s)",
        "last request written (ms)",
        "client CPU (s)",
    ]
    rows = []
    for name, run in deployments.items():
        if not run["bursts"]:
            rows.append([name, "-", f"not run: {run.get('error')}", *[""] * (len(header) - 3)])
        for size, s in run["bursts"].items():
            kinds = [
                s["refused_by"].get(kind, 0) for kind in ("HTTP 429", "HTTP 503", "error event")
            ]
            died = str(s["died"]) if s["died"] == 0 else f"**{s['died']} (must be 0)**"
            rows.append(
                [
                    name,
                    size,
                    f"{s['completed']}/{s['requests']}",
                    f"{s['refused']} ({' / '.join(map(str, kinds))})",
                    died,
                    str(s["timed_out"]),
                    str(s["failed"]),
                    _pair(s, "ttft"),
                    _pair(s, "refusal"),
                    f"{s['drain_s']:.1f}" if _finite(s["drain_s"]) else "n/a",
                    f"{s['last_written_s'] * 1000:.0f}" if _finite(s["last_written_s"]) else "n/a",
                    f"{s['client_cpu_s']:.1f}",
                ]
            )
    return md_table(header, rows)


def _mib(memory: dict | None) -> str:
    if not memory or memory["peak"] is None:
        return "-"
    growth = f" ({(memory['peak'] - memory['before']) / 1024:+.0f})" if memory["before"] else ""
    return f"{memory['peak'] / 1024:.0f}{growth}"


def memory_table(deployments: dict) -> str:
    runs = [
        (name, size, s) for name, run in deployments.items() for size, s in run["bursts"].items()
    ]
    labels = sorted({label for *_, s in runs for label in s["memory_kib"]})
    labels.sort(key=lambda label: label != "router")
    rows = [
        [name, size, *(_mib(s["memory_kib"].get(lb)) for lb in labels)] for name, size, s in runs
    ]
    return md_table(["deployment", "burst", *labels], rows)


def ratio_table(deployments: dict) -> str | None:
    ran = [name for name, run in deployments.items() if run["bursts"]]
    if len(ran) < 2:
        return None
    base_name = "colocated" if "colocated" in ran else ran[0]
    base = deployments[base_name]["bursts"]
    rows = []
    for name in ran:
        for size, s in deployments[name]["bursts"].items():
            if name == base_name or size not in base:
                continue
            b = base[size]
            rss, base_rss = (
                sum(m["peak"] or 0 for m in run["memory_kib"].values()) for run in (s, b)
            )
            rows.append(
                [
                    f"{name} / {base_name}",
                    size,
                    f"{s['completed']} vs {b['completed']}",
                    _ratio(s["drain_s"], b["drain_s"]),
                    _ratio(s["ttft_p99"], b["ttft_p99"]),
                    _ratio(rss, base_rss),
                ]
            )
    header = ["ratio", "burst", "completed", "drain", "TTFT P99", "peak RSS, all processes"]
    return md_table(header, rows)


def not_completed_lines(deployments: dict) -> list[str]:
    lines = []
    for name, run in deployments.items():
        for size, s in run["bursts"].items():
            if s["not_completed"]:
                reasons = "; ".join(f"{n} x {why}" for why, n in s["not_completed"].items())
                lines.append(f"- {name}, burst {size}: {reasons}")
            if s["replaced_processes"]:
                replaced = ", ".join(s["replaced_processes"])
                lines.append(f"- {name}, burst {size}: processes replaced during it: {replaced}")
        if run.get("error"):
            lines.append(f"- {name}: {run['error']}")
    return lines


def markdown(result: dict) -> str:
    deployments = result["deployments"]
    servers = [
        [name, f"`pdserve serve {' '.join(run['flags'])}`"] for name, run in deployments.items()
    ]
    setup = "; ".join(f"{key}: {value}" for key, value in result["setup"].items())
    died = sum(s["died"] for run in deployments.values() for s in run["bursts"].values())
    parts = [
        "# Burst: concurrent streaming completions sent at once",
        f"Command: `{result['command']}`",
        md_table(["machine", ""], [[key, str(value)] for key, value in result["machine"].items()]),
        md_table(["deployment", "server"], servers),
        f"Setup: {setup}.",
        "## Outcomes",
        (
            "Every request is counted once: completed + refused + died + timed out + failed = "
            "burst. TTFT of the completed requests; time to refusal of the refused ones; drain: "
            "burst start to the end of the last answer; last request written: when the client had "
            "written the last whole request to its connection (a large value would mean the "
            "client, not the server, was the bottleneck)."
        ),
        outcome_table(deployments),
        "Died after a token: 0 in every run."
        if died == 0
        else f"**Died after a token: {died} requests (must be 0); see below.**",
        "## Peak RSS (MiB)",
        (
            "Largest VmRSS sampled every 100 ms during the burst, with its growth over the RSS "
            "just before the burst in parentheses."
        ),
        memory_table(deployments),
    ]
    ratios = ratio_table(deployments)
    if ratios:
        parts += ["## Ratios (lower drain, TTFT and RSS are better)", ratios]
    lines = not_completed_lines(deployments)
    parts += ["## Requests that did not complete", "\n".join(lines) or "None."]
    return "\n\n".join(parts) + "\n"


# -- the command -------------------------------------------------------------------------------


