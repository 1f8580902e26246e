"""The soak's report (bench/soak.py): markdown tables from its JSON record, formatting only."""

from __future__ import annotations

from pdserve.bench.burst_report import OUTCOME_COLUMNS, outcome_cells
from pdserve.bench.report import md_table


def outcome_table(outcomes: dict) -> str:
    rows = [
        [
            f"**{kind}**" if kind == "all" else kind,
            str(s["requests"]),
            str(s["completed"]),
            *outcome_cells(s),
        ]
        for kind, s in outcomes.items()
    ]
    return md_table(["kind", "requests", "completed", *OUTCOME_COLUMNS], rows)


def health_table(result: dict) -> str:
    settle, nodes, kill = result["settle"], result["nodes"], result["kill"]
    died = result["outcomes"]["all"]["died"]
    leaked = result["leaked_blocks_at_end"]
    settled = (
        f"KV usage 0 on every live node after {settle['waited_s']:.1f} s"
        if settle["clean"]
        else f"**not clean after {settle['waited_s']:.0f} s: {settle['nodes']}**"
    )
    downs = nodes["down_while_alive"]
    down_text = str(len(downs)) + (
        "" if not downs else " (" + ", ".join(f"{d['node']} at {d['at_s']} s" for d in downs) + ")"
    )
    detected = (
        f"{kill['detected_s']:.2f} ({kill['node']})" if "detected_s" in kill
        else f"**{kill.get('error')}** ({kill.get('node', '-')})"
    )
    rows = [
        ["died after a token (must be 0)", str(died) if died == 0 else f"**{died}**"],
        ["leaked KV blocks at end (must be 0)", "unknown" if leaked is None else f"{leaked:g}"],
        ["settle after the traffic", settled],
        [f"node-down events while alive ({nodes['scrapes']} scrapes)", down_text],
        ["failed /metrics scrapes", str(len(nodes["failed_scrapes"]))],
        ["node processes replaced during the traffic", ", ".join(nodes["replaced_processes"])
         or "none"],
        ["kill -9 detection (s)", detected],
    ]
    return md_table(["check", "result"], rows)


def not_completed_lines(outcomes: dict) -> list[str]:
    return [
        f"- {kind}: " + "; ".join(f"{n} x {why}" for why, n in s["not_completed"].items())
        for kind, s in outcomes.items()
        if kind != "all" and s["not_completed"]
    ]


def markdown(result: dict) -> str:
    setup = "; ".join(f"{key}: {value}" for key, value in result["setup"].items())
    parts = [
        "# Soak: mixed streaming traffic on a loaded host",
        f"Command: `{result['command']}`",
        md_table(["machine", ""], [[key, str(value)] for key, value in result["machine"].items()]),
        f"Setup: {setup}.",
        f"## Outcomes ({result['traffic_s'] / 60:.1f} min of traffic)",
        (
            "Every request is counted once: completed + refused + died + timed out + failed = "
            "requests. TTFT (send to the first token) of the completed requests; time to refusal "
            "(send to the end of the answer) of the refused ones."
        ),
        outcome_table(result["outcomes"]),
        "## Health",
        (
            "Node-down events: a scrape of /metrics every few seconds that shows a node's "
            "`pdserve_node_up` not 1 while its process is alive, counted once per fall. Kill -9 "
            "detection: the kill to the first scrape (every 50 ms) showing the node down."
        ),
        health_table(result),
        "## Requests that did not complete",
        "\n".join(not_completed_lines(result["outcomes"])) or "None.",
    ]
    return "\n\n".join(parts) + "\n"
