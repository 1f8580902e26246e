"""How `pdserve plan --workload` prints its recommendation: a table of the best candidates
(or JSON with `--json`), the profile it used and the SLO."""

from __future__ import annotations

import json

from pdserve.planner.profile_file import Profile
from pdserve.planner.search import Ranked
from pdserve.planner.slo import PlanSlo


def _best_per_layout(ranked: list[Ranked]) -> list[Ranked]:
    """The best candidate of each layout and policy, in rank order."""
    seen, out = set(), []
    for r in ranked:
        key = (r.candidate.layout, r.candidate.placement.policy)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def render_table(ranked: list[Ranked], profile: Profile, slo: PlanSlo, devices: int) -> str:
    best = ranked[0]
    lines = [
        (f"profile: {profile.model} ({profile.dtype}) on {profile.device}, measured "
        f"{profile.machine.get('date', '?')} ({profile.machine.get('cpu', '?')})"),
        (f"SLO: TTFT <= {slo.ttft_s:g} s and mean ITL <= {slo.itl_s:g} s; {devices} devices; "
        f"{len(ranked)} candidates simulated"),
        "",
        (f"{'layout':<14} {'policy':<7} {'chunk':>6} {'local tok':>9} {'delay s':>7} "
        f"{'goodput/dev':>11} {'SLO met':>7} {'TTFT P50/P99 s':>15} {'ITL P50/P99 ms':>15}"),
    ]
    for r in _best_per_layout(ranked):
        c, s = r.candidate, r.summary
        auto = c.placement.policy.value == "auto"
        lines.append(
            f"{c.layout.name:<14} {c.placement.policy.value:<7} {c.chunk_tokens:>6} "
            f"{c.placement.local_prefill_tokens if auto else '-':>9} "
            f"{f'{c.placement.local_prefill_queue_delay_s:g}' if auto else '-':>7} "
            f"{r.goodput_per_device:>11.3f} {s.attainment:>7.2f} "
            f"{f'{s.ttft_p50:.2f}/{s.ttft_p99:.2f}':>15} "
            f"{f'{s.itl_p50 * 1e3:.0f}/{s.itl_p99 * 1e3:.0f}':>15}"
        )
    lines += ["", f"recommended: {best.candidate.command()}"]
    return "\n".join(lines)


def render_json(ranked: list[Ranked], profile: Profile, slo: PlanSlo, devices: int) -> str:
    def entry(r: Ranked) -> dict:
        c, s = r.candidate, r.summary
        return {
            "layout": c.layout.name, "prefill_nodes": c.layout.prefill_nodes,
            "decode_nodes": c.layout.decode_nodes, "policy": c.placement.policy.value,
            "chunk_tokens": c.chunk_tokens,
            "local_prefill_tokens": c.placement.local_prefill_tokens,
            "local_prefill_queue_delay_s": c.placement.local_prefill_queue_delay_s,
            "goodput": s.goodput, "goodput_per_device": r.goodput_per_device,
            "slo_attainment": s.attainment, "ttft_p50": s.ttft_p50, "ttft_p99": s.ttft_p99,
            "itl_p50": s.itl_p50, "itl_p99": s.itl_p99, "placements": s.placements,
            "command": c.command(),
        }

    return json.dumps({
        "profile": {"model": profile.model, "dtype": profile.dtype, "device": profile.device},
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}, "devices": devices,
        "recommended": entry(ranked[0]),
        "best_per_layout": [entry(r) for r in _best_per_layout(ranked)],
    }, indent=1)
