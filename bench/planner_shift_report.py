"""The report and plot of bench/planner_shift.py from its JSON record (formatting only)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from pdserve.bench.report import md_table

CHANGED = re.compile(
    r"changed node (?P<old>\S+): (?P<from>\w+) -> (?P<to>\w+) \(reason (?P<reason>\w+); "
    r"(?P<signals>.*)\); now node (?P<new>\S+), serving after (?P<serving>[\d.]+) s "
    r"\(drained in (?P<drained>[\d.]+) s\)"
)
DRAINING = re.compile(r"planner: draining node (?P<node>\S+):")


def role_changes(record: dict) -> list[dict]:
    """Each change the launcher logged, with when its drain began (the sampler's time)."""
    began = {}
    changes = []
    for event in record["events"]:
        if (match := DRAINING.search(event["line"])) is not None:
            began[match["node"]] = event["t"]
        elif (match := CHANGED.search(event["line"])) is not None:
            done = event["t"]
            start = began.get(match["old"], done - float(match["serving"]))
            changes.append({**match.groupdict(), "began_t": start, "done_t": done})
    return changes


def outcome_rows(record: dict) -> list[list[str]]:
    rows = []
    for phase in [p["name"] for p in record["phases"]]:
        outcomes = Counter(record["outcomes"][phase])
        sent = sum(outcomes.values())
        others = ", ".join(f"{k}: {v}" for k, v in outcomes.items() if k != "completed")
        rows.append([phase, str(sent), str(outcomes["completed"]),
                     str(sent - outcomes["completed"]), others or "-"])
    return rows


def report(record: dict) -> str:
    machine = record["machine"]
    changes = role_changes(record)
    change_rows = [
        [f"{c['began_t']:.1f}", f"{c['done_t']:.1f}", f"{c['old']} -> {c['new']}",
         f"{c['from']} -> {c['to']}", c["reason"], c["drained"], c["serving"], c["signals"]]
        for c in changes
    ]
    phase_rows = [
        [p["name"], f"{p['start']:.1f}", f"{p['end']:.1f}",
         f"{p['changed_at']:.1f}" if p["changed_at"] is not None else "no change"]
        for p in record["phases"]
    ]
    clients = record["phases_config"]
    load_rows = [
        [name, str(c), f"{lo}-{hi}", f"{fewest}-{most}" if fewest != most else str(most)]
        for name, (c, (lo, hi), (fewest, most)) in clients.items()
    ]
    lost = len(record["not_completed"])
    settle = record["settle"]
    leak = (
        "every live node idle with 0 leaked blocks" if settle["clean"]
        else f"NOT clean: {settle['nodes']}"
    )
    return "\n\n".join([
        "# The run-time planner under a shifting load",
        ("`pdserve serve` with `--planner load`, 1 prefill + 2 decode nodes at the start, under a "
        "closed-loop load that shifts from long prompts to long outputs. What roles the nodes "
        "took when, and whether any request was lost on the way. Model: "
        f"{record['model']}: the run measures the planner's mechanics, not a model's speed."),
        f"Command: `{record['command']}`",
        md_table(["machine", ""], [[k, str(v)] for k, v in machine.items()]),
        f"Deployment flags: `pdserve serve MODEL {' '.join(record['serve_flags'])}`",
        ("Load (each client sends its next streaming request, EOS ignored, when its last one "
        f"ends; a phase ends {record['hold_s']:g} s after the planner's next change is counted):"),
        md_table(["phase", "clients", "prompt tokens", "output tokens"], load_rows),
        md_table(["phase", "start (s)", "end (s)", "change counted at (s)"], phase_rows),
        "## Role changes",
        md_table(
            ["drain began (s)", "serving (s)", "node", "roles", "reason", "drained in (s)",
             "serving after (s)", "signals that decided it"],
            change_rows,
        ) if change_rows else "No role change happened.",
        "## Requests",
        md_table(["phase", "sent", "completed", "not completed", "other outcomes"],
                 outcome_rows(record)),
        (f"Not completed in all: **{lost}**. After the load: {leak} "
        f"(waited {settle['waited_s']:.1f} s)."),
        "![roles, signals and requests over time](planner_shift.png)",
    ]) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = record["samples"]
    times = [s["t"] for s in samples]
    figure, (roles, signals, served) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for axis in (roles, signals, served):
        for index, phase in enumerate(record["phases"]):
            axis.axvspan(phase["start"], phase["end"], color=f"C{index + 4}", alpha=0.08)
    for index, phase in enumerate(record["phases"]):
        roles.text(phase["start"] + 1, 3.15, phase["name"], color=f"C{index + 4}")
    roles.step(times, [s["prefill"] for s in samples], where="post", label="prefill nodes")
    roles.step(times, [s["decode"] for s in samples], where="post", label="decode nodes")
    for change in role_changes(record):
        roles.axvspan(change["began_t"], change["done_t"], color="grey", alpha=0.25)
        roles.axvline(change["done_t"], color="black", linewidth=0.8)
        roles.text(change["done_t"], 0.2, f" {change['from']}->{change['to']}", fontsize=8)
    roles.set_ylim(0, 3.5)
    roles.set_ylabel("nodes serving")
    roles.legend(loc="upper right", fontsize=8)
    roles.set_title("roles (grey: a node draining and restarting in its new role)")
    signals.plot(times, [s["prefill_delay_s"] for s in samples], color="C0",
                 label="prefill queue delay (s)")
    signals.set_ylabel("prefill queue delay (s)")
    usage = signals.twinx()
    usage.plot(times, [s["decode_kv_usage"] for s in samples], color="C1",
               label="decode KV usage")
    usage.set_ylim(0, 1)
    usage.set_ylabel("decode KV usage")
    flags = record["serve_flags"]
    for flag, axis, color in (
        ("--planner-prefill-delay-high", signals, "C0"),
        ("--planner-kv-usage-high", usage, "C1"),
        ("--planner-kv-usage-low", usage, "C1"),
    ):
        axis.axhline(float(flags[flags.index(flag) + 1]), color=color, linestyle=":",
                     linewidth=0.8)
    signals.set_title("signals the planner reads (dotted: thresholds)")
    done = record["completed_end_s"]
    lost = [r["end_s"] for r in record["not_completed"]]
    end = max([times[-1] if times else 0.0, *done, *lost])
    bins = [5.0 * i for i in range(int(end // 5) + 2)]
    served.hist(done, bins=bins, color="C2", label="completed")
    if lost:
        served.hist(lost, bins=bins, color="C3", label="not completed")
    served.set_ylabel("requests per 5 s")
    served.set_xlabel("seconds since the deployment was ready")
    served.legend(loc="upper right", fontsize=8)
    served.set_title(f"requests: {len(done)} completed, {len(lost)} not completed")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
