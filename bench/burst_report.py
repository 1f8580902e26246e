"""The burst benchmark's report (bench/burst.py): markdown tables from its JSON record,
formatting only."""

from __future__ import annotations

import math

from pdserve.bench.report import md_table

REFUSAL_KINDS = ("HTTP 429", "HTTP 503", "error event")
OUTCOME_COLUMNS = [
    "refused (429 / 503 / error event)",
    "died after a token",
    "timed out",
    "failed",
    "TTFT P50 / P99 (s)",
    "refusal P50 / P99 (s)",
]


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _pair(summary: dict, name: str) -> str:
    low, high = summary[f"{name}_p50"], summary[f"{name}_p99"]
    return f"{low:.2f} / {high:.2f}" if _finite(low) and _finite(high) else "n/a"


def _ratio(ours: float | None, base: float | None) -> str:
    return f"{ours / base:.2f}x" if _finite(ours) and _finite(base) and base else "n/a"


def _loaded(run: dict) -> bool:
    return bool(run.get("loaded_host"))


def _same_load_base(name: str, deployments: dict) -> str | None:
    """The run this one is compared with on the same host: colocated, else the first run."""
    same_load = [
        other
        for other, run in deployments.items()
        if run["bursts"] and _loaded(run) == _loaded(deployments[name])
    ]
    colocated = [o for o in same_load if deployments[o].get("deployment", o) == "colocated"]
    base = (colocated or same_load or [None])[0]
    return base if base != name else None


def _idle_counterpart(name: str, deployments: dict) -> str | None:
    run = deployments[name]
    if not _loaded(run):
        return None
    idle = [
        other
        for other, o in deployments.items()
        if o["bursts"] and not _loaded(o) and o.get("deployment", other) == run.get("deployment")
    ]
    return idle[0] if idle else None


def outcome_cells(summary: dict) -> list[str]:
    """One summary's cells under OUTCOME_COLUMNS (a burst's here, a request kind's in
    bench/soak_report.py)."""
    kinds = [summary["refused_by"].get(kind, 0) for kind in REFUSAL_KINDS]
    died = summary["died"]
    return [
        f"{summary['refused']} ({' / '.join(map(str, kinds))})",
        str(died) if died == 0 else f"**{died} (must be 0)**",
        str(summary["timed_out"]),
        str(summary["failed"]),
        _pair(summary, "ttft"),
        _pair(summary, "refusal"),
    ]


def client_floor_table(floors: dict, deployments: dict) -> str | None:
    rows = []
    for host, bursts in floors.items():
        if "error" in bursts:
            rows.append([host, "-", f"not run: {bursts['error']}", "", "", "", ""])
            continue
        loaded = host == "loaded"
        for size, f in bursts.items():
            beside = [
                f"{name}: {run['bursts'][size]['refusal_p99']:.2f}"
                for name, run in deployments.items()
                if run.get("loaded_host") == loaded
                and size in run["bursts"]
                and _finite(run["bursts"][size].get("refusal_p99"))
            ]
            rows.append(
                [
                    host,
                    size,
                    f"{f['refused']}/{size}",
                    _pair(f, "refusal"),
                    f"{f['last_written_s'] * 1000:.0f}" if _finite(f["last_written_s"]) else "n/a",
                    f"{f['client_cpu_s']:.1f}",
                    "; ".join(beside) or "-",
                ]
            )
    if not rows:
        return None
    header = ["host", "burst", "refused", "refusal P50 / P99 (s)", "last request written (ms)",
              "client CPU (s)", "deployments' refusal P99 (s)"]
    return md_table(header, rows)


def outcome_table(deployments: dict) -> str:
    header = [
        "deployment",
        "burst",
        "completed",
        *OUTCOME_COLUMNS,
        "drain (s)",
        "last request written (ms)",
        "client CPU (s)",
        "router CPU (s)",
    ]
    rows = []
    for name, run in deployments.items():
        if not run["bursts"]:
            rows.append([name, "-", f"not run: {run.get('error')}", *[""] * (len(header) - 3)])
        for size, s in run["bursts"].items():
            rows.append(
                [
                    name,
                    size,
                    f"{s['completed']}/{s['requests']}",
                    *outcome_cells(s),
                    f"{s['drain_s']:.1f}" if _finite(s["drain_s"]) else "n/a",
                    f"{s['last_written_s'] * 1000:.0f}" if _finite(s["last_written_s"]) else "n/a",
                    f"{s['client_cpu_s']:.1f}",
                    f"{s['router_cpu_s']:.1f}" if s.get("router_cpu_s") is not None else "-",
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
    """Each run against the colocated run on the same host (idle or loaded), then each loaded
    run against the same deployment idle."""
    ran = [name for name, run in deployments.items() if run["bursts"]]
    pairs = [(name, _same_load_base(name, deployments)) for name in ran]
    pairs += [(name, _idle_counterpart(name, deployments)) for name in ran]
    rows = []
    for name, base_name in pairs:
        if base_name is None:
            continue
        base = deployments[base_name]["bursts"]
        for size, s in deployments[name]["bursts"].items():
            if size not in base:
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
    if not rows:
        return None
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


def _host(run: dict) -> str:
    if not _loaded(run):
        return "idle"
    busy = run.get("busy_processes")
    return f"loaded: {busy} busy-looping processes" if busy else "loaded"


def server_table(deployments: dict) -> str:
    rows = []
    for name, run in deployments.items():
        load = run.get("load_average", {})
        rows.append(
            [
                name,
                f"`pdserve serve {' '.join(run['flags'])}`",
                _host(run),
                f"{load.get('before bursts', '-')} / {load.get('after bursts', '-')}",
            ]
        )
    header = ["deployment", "server", "host during the bursts", "load average before / after"]
    return md_table(header, rows)


def loaded_host_text(deployments: dict) -> str | None:
    if not any(_loaded(run) for run in deployments.values()):
        return None
    return (
        'Loaded host: a deployment labelled "(loaded host)" is started afresh and warmed up like '
        "the idle one, then given the same bursts while one busy-looping Python process per "
        "usable core of this machine runs beside it at normal priority (bench/cpu_hog.py), "
        "started after the warm-up and stopped after the last burst: every core is shared, as "
        "on a GPU host whose CPUs serve other work. The load average (1 min) is taken after the "
        "warm-up, before the busy processes start, and after the last burst, before they stop."
    )


def markdown(result: dict) -> str:
    deployments = result["deployments"]
    setup = "; ".join(f"{key}: {value}" for key, value in result["setup"].items())
    died = sum(s["died"] for run in deployments.values() for s in run["bursts"].values())
    parts = [
        "# Burst: concurrent streaming completions sent at once",
        f"Command: `{result['command']}`",
        md_table(["machine", ""], [[key, str(value)] for key, value in result["machine"].items()]),
        server_table(deployments),
        f"Setup: {setup}.",
        *filter(None, [loaded_host_text(deployments)]),
        "## Outcomes",
        (
            "Every request is counted once: completed + refused + died + timed out + failed = "
            "burst. TTFT of the completed requests; time to refusal of the refused ones; drain: "
            "burst start to the end of the last answer; last request written: when the client had "
            "written the last whole request to its connection (a large value would mean the "
            "client, not the server, was the bottleneck); client CPU and router CPU: the CPU "
            "time (user + system) each process used during the burst, on a host where they share "
            "the cores with the nodes (and the busy processes, when loaded)."
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
    floor = client_floor_table(result.get("client_floor") or {}, deployments)
    if floor:
        parts += [
            "## Client floor",
            (
                "The same bursts from the same client against a server that refuses every "
                "request at once (bench/client_floor.py), on the same host, idle or loaded: the "
                "time to refusal no server could beat with this client there. Beside it, each "
                "deployment's refusal P99 on that host."
            ),
            floor,
        ]
    ratios = ratio_table(deployments)
    if ratios:
        parts += ["## Ratios (lower drain, TTFT and RSS are better)", ratios]
    lines = not_completed_lines(deployments)
    parts += ["## Requests that did not complete", "\n".join(lines) or "None."]
    return "\n\n".join(parts) + "\n"


# -- the command -------------------------------------------------------------------------------


