"""The planner's simulator against real runs: predicted vs measured TTFT and ITL, P50 and P99,
per layout and load, on bench/goodput.py's workloads and layouts.

    python -m pdserve.bench.plan_check [goodput's flags: --quick --rates --requests ...]

One run measures a profile in this process (`pdserve profile`'s grid, planner/profile.py)
before any server starts, then serves bench/goodput.py's loads (its workload, its layouts,
its flags: one source) on real deployments, and simulates the same requests at the same
times on the same layouts with that profile. The simulated nodes get the threads
`pdserve serve` gives the real ones on this host (commands/node_threads.py): a colocated node
every usable core; in 1P1D one share each, the decode node every core while the prefill
node idles. Error: |predicted - measured| / measured per number, summarized per latency
(median and worst over layouts and loads). Writes plan_check.md and plan_check.json
(bench/results/ unless `--out-dir`; nothing with `--quick`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from pdserve.bench import goodput
from pdserve.bench.disagg_vs_colocated import vocabulary
from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.bench.report import md_table
from pdserve.bench.serve_load import LoadRequest
from pdserve.commands.node_threads import usable_cores
from pdserve.planner.profile import measure_profile, summary_rows
from pdserve.planner.profile_file import Profile
from pdserve.planner.profile_model import StepCost
from pdserve.planner.simulator import Layout, NodeCosts, SimSettings, simulate
from pdserve.planner.slo import PlanSlo, summarize
from pdserve.planner.workload import SimRequest
from pdserve.router.cluster.prefill_placement import DisaggPolicy, PlacementSettings

LATENCIES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
SIM_LAYOUTS = {  # bench/goodput.py's LAYOUTS, as the simulator's
    "colocated": (Layout(0, 1), DisaggPolicy.NEVER),
    "1p1d always": (Layout(1, 1), DisaggPolicy.ALWAYS),
    "1p1d auto": (Layout(1, 1), DisaggPolicy.AUTO),
}


def sim_requests(requests: list[LoadRequest]) -> list[SimRequest]:
    """goodput's requests as lengths; a chat turn's system prompt is its shared prefix."""
    out = []
    for r in requests:
        if r.kind == "chat":
            system = r.prompt[: goodput.SYSTEM_TOKENS]
            out.append(SimRequest(r.at, len(r.prompt), r.max_tokens, str(hash(tuple(system))),
                                  goodput.SYSTEM_TOKENS, r.kind))
        else:
            out.append(SimRequest(r.at, len(r.prompt), r.max_tokens, kind=r.kind))
    return out


def layout_costs(profile: Profile, layout: Layout, cores: int) -> NodeCosts:
    """The threads `pdserve serve` gives each node on this host (commands/node_threads.py)."""
    whole = StepCost.fit(profile.table(cores))
    if layout.prefill_nodes == 0:
        return NodeCosts(prefill=whole, decode=whole)
    share = StepCost.fit(profile.table(max(1, cores // layout.devices)))
    return NodeCosts(prefill=share, decode=share, decode_while_prefill_idle=whole)


def predict(profile: Profile, workloads: dict, args, cores: int) -> dict[str, dict[str, dict]]:
    slo = PlanSlo(args.slo_ttft, args.slo_tpot)
    out: dict[str, dict[str, dict]] = {}
    for name, (layout, policy) in SIM_LAYOUTS.items():
        settings = SimSettings(
            layout, PlacementSettings(policy), profile.max_num_batched_tokens,
            profile.kv_capacity_tokens, profile.kv_bytes_per_token,
            profile.transfer_bytes_per_s, profile.block_size,
        )
        costs = layout_costs(profile, layout, cores)
        out[name] = {}
        for load, (requests, concurrency) in workloads.items():
            summary = summarize(simulate(sim_requests(requests), settings, costs, concurrency),
                                slo)
            out[name][load] = {
                "goodput": summary.goodput, "ttft_p50": summary.ttft_p50,
                "ttft_p99": summary.ttft_p99, "itl_p50": summary.itl_p50,
                "itl_p99": summary.itl_p99, "placements": summary.placements,
            }
    return out


def relative_errors(predicted: dict, measured: dict) -> dict[str, list[float]]:
    errors: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for layout, loads in predicted.items():
        for load, numbers in loads.items():
            for name in LATENCIES:
                real = measured[layout][load][name]
                if real > 0:
                    errors[name].append(abs(numbers[name] - real) / real)
    return errors


def report(args, machine: dict, profile: Profile, predicted: dict, measured: dict) -> str:
    errors = relative_errors(predicted, measured)
    sections = [
        "# Planner check: simulated vs measured TTFT and ITL",
        f"Command: `{command_line()}`",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        (
            f"Model: {profile.model} ({profile.dtype}). The profile was measured in this run "
            f"({profile.seconds:.0f} s, in this process before any server started); the "
            "measured numbers are bench/goodput.py's loads served by `pdserve serve` in this "
            "run; the predictions simulate the same requests at the same times on the same "
            "layouts (planner/simulator.py). SLO for goodput: TTFT <= "
            f"{args.slo_ttft} s and TPOT <= {args.slo_tpot} s."
        ),
        "## Profile",
        md_table(["threads", "prefill tokens/s by prompt tokens", "decode ms by batch x context"],
                 summary_rows(profile)),
    ]
    for load in next(iter(measured.values())):
        rows = []
        for layout in measured:
            p, m = predicted[layout][load], measured[layout][load]
            rows.append([
                layout,
                f"{p['ttft_p50']:.2f} / {m['ttft_p50']:.2f}",
                f"{p['ttft_p99']:.2f} / {m['ttft_p99']:.2f}",
                f"{p['itl_p50'] * 1e3:.0f} / {m['itl_p50'] * 1e3:.0f}",
                f"{p['itl_p99'] * 1e3:.0f} / {m['itl_p99'] * 1e3:.0f}",
                f"{p['goodput']:.3f} / {m['goodput']:.3f}",
            ])
        sections += [f"## {load} (predicted / measured)", md_table(
            ["layout", "TTFT P50 (s)", "TTFT P99 (s)", "ITL P50 (ms)", "ITL P99 (ms)",
             "goodput (req/s)"], rows,
        )]
    rows = [
        [name, f"{statistics.median(values):.0%}", f"{max(values):.0%}", str(len(values))]
        for name, values in errors.items() if values
    ]
    sections += [
        "## Error: |predicted - measured| / measured, over layouts and loads",
        md_table(["latency", "median", "worst", "numbers"], rows),
        f"Load average at end: {load_average()}.",
    ]
    return "\n\n".join(sections) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = goodput.parse_args(argv)
    machine = machine_info()
    cores = usable_cores()
    profile = measure_profile(args.model, quick=args.quick, threads=sorted({1, cores // 2,
                                                                            cores}))
    print(f"[{time.strftime('%H:%M:%S')}] profile measured in {profile.seconds:.0f} s: "
          f"{summary_rows(profile)}", flush=True)
    workloads = goodput.loads(vocabulary(args.model), args)
    predicted = predict(profile, workloads, args, cores)
    measured = {
        name: goodput.run_layout(flags, workloads, args)
        for name, flags in goodput.LAYOUTS.items()
    }
    text = report(args, machine, profile, predicted, measured)
    print(text)
    if not args.quick:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "plan_check.md").write_text(text)
        (args.out_dir / "plan_check.json").write_text(json.dumps(
            {"machine": machine, "profile": dataclasses.asdict(profile),
             "predicted": predicted, "measured": measured,
             "errors": relative_errors(predicted, measured)}, indent=1, default=str,
        ))


if __name__ == "__main__":
    main()
