"""`pdserve profile` and `pdserve plan --workload`: measure one node of a model on this device,
then simulate a workload on every layout and print the one with the best goodput per device
(planner/). `pdserve plan` without `--workload` is the KV capacity plan (commands/plan.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_PROFILE = Path("pdserve-profile.json")
MAX_THREADS = 1024


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    profile = sub.add_parser(
        "profile", help="measure one node's prefill and decode step times on this device"
    )
    profile.add_argument("--model", default=None, help="a model folder (default: the default "
                         "model)")
    profile.add_argument("--out", type=Path, default=DEFAULT_PROFILE,
                         help=f"the profile to write (default {DEFAULT_PROFILE})")
    profile.add_argument("--threads", default=None, metavar="N,M",
                         help="thread counts to measure (default: 1 and every usable core "
                         "on a CPU host)")
    profile.add_argument("--quick", action="store_true",
                         help="a small grid: seconds, for a smoke test")
    profile.set_defaults(run=cmd_profile, parser=profile)


def add_workload_flags(plan: argparse.ArgumentParser) -> None:
    group = plan.add_argument_group("workload plan (with --workload)")
    group.add_argument("--workload", type=Path, default=None, metavar="FILE",
                       help="a workload file (JSON: docs/planning.md); selects the workload plan")
    group.add_argument("--slo", default=None, metavar="ttft=S,itl=S",
                       help="the SLO a request must meet to count toward goodput, in seconds")
    group.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="FILE",
                       help=f"written by `pdserve profile` (default {DEFAULT_PROFILE})")
    group.add_argument("--devices", type=int, default=2, help="devices to lay out (default 2)")
    group.add_argument("--threads-per-device", type=int, default=None, metavar="N",
                       help="on a CPU host, the profile's table for N threads (default: its "
                       "largest)")


def parse_threads(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--threads is {text!r}; expected counts like 1,2") from None
    if not counts or any(not 1 <= n <= MAX_THREADS for n in counts):
        raise ValueError(f"--threads is {text!r}; expected counts from 1 to {MAX_THREADS}")
    return sorted(set(counts))


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profile import measure_profile, summary_rows
    from pdserve.planner.profile_file import save_profile

    threads = parse_threads(args.threads)
    profile = measure_profile(args.model, quick=args.quick, threads=threads)
    save_profile(profile, args.out)
    print(f"{profile.model} ({profile.dtype}) on {profile.device}: measured in "
          f"{profile.seconds:.0f} s, written to {args.out}")
    for threads_text, prefill, decode in summary_rows(profile):
        print(f"threads {threads_text}: prefill tokens/s by prompt: {prefill}; "
              f"decode ms by batch x context: {decode}")
    return 0


def cmd_workload_plan(args: argparse.Namespace) -> int:
    from pdserve.planner.profile_file import load_profile
    from pdserve.planner.report import render_json, render_table
    from pdserve.planner.search import search
    from pdserve.planner.slo import parse_plan_slo
    from pdserve.planner.workload import load_workload

    if args.slo is None:
        raise ValueError("--workload needs --slo ttft=SECONDS,itl=SECONDS")
    slo = parse_plan_slo(args.slo)
    if args.threads_per_device is not None and not (
        1 <= args.threads_per_device <= MAX_THREADS
    ):
        raise ValueError(f"--threads-per-device is {args.threads_per_device}; expected 1 to "
                         f"{MAX_THREADS}")
    if not args.profile.is_file():
        raise ValueError(f"no profile at {args.profile}; measure one with `pdserve profile "
                         f"--out {args.profile}`")
    profile = load_profile(args.profile)
    requests = load_workload(args.workload).sample()
    ranked = search(requests, profile, slo, args.devices, args.threads_per_device)
    render = render_json if args.json else render_table
    print(render(ranked, profile, slo, args.devices))
    return 0
