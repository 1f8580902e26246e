"""The plan: every layout of a given number of devices, chunk size and placement threshold,
simulated on the workload and ranked by goodput per device.

Candidates for N devices (a device runs one node, as the profile measured it):
  N colocated nodes (every prompt computed where it decodes), and
  xPyD for every x + y = N, with policy `always`, or `auto` at each pair of thresholds
  (LOCAL_PREFILL_TOKENS x LOCAL_PREFILL_QUEUE_DELAYS_S),
each at every chunk size (`--max-num-batched-tokens`, CHUNK_TOKENS). The ranking: goodput
per device, then SLO attainment, then the smaller chunk (ties are common at light load).
The simulation is deterministic, so the same files give the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.profile_file import Profile
from pdserve.planner.profile_model import StepCost
from pdserve.planner.simulator import Layout, NodeCosts, SimSettings, simulate
from pdserve.planner.slo import PlanSlo, SimSummary, summarize
from pdserve.planner.workload import SimRequest
from pdserve.router.cluster.prefill_placement import DisaggPolicy, PlacementSettings

CHUNK_TOKENS = (256, 512, 1024, 2048)
LOCAL_PREFILL_TOKENS = (128, 512, 1024, 2048)
LOCAL_PREFILL_QUEUE_DELAYS_S = (0.5, 1.0, 2.0)
MAX_DEVICES = 16


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    chunk_tokens: int
    placement: PlacementSettings

    def command(self) -> str:
        """The command that deploys it (N colocated nodes: N `pdserve colocated` nodes
        joining one router)."""
        chunk = f"--max-num-batched-tokens {self.chunk_tokens}"
        layout = self.layout
        if layout.prefill_nodes == 0:
            if layout.decode_nodes == 1:
                return f"pdserve serve --colocated {chunk}"
            return f"{layout.decode_nodes} x pdserve colocated {chunk} (one router)"
        flags = f"pdserve serve --prefill {layout.prefill_nodes} --decode " \
            f"{layout.decode_nodes} {chunk} --disagg-policy {self.placement.policy.value}"
        if self.placement.policy is DisaggPolicy.AUTO:
            flags += (f" --local-prefill-tokens {self.placement.local_prefill_tokens}"
                      f" --local-prefill-queue-delay {self.placement.local_prefill_queue_delay_s:g}")
        return flags


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    summary: SimSummary

    @property
    def goodput_per_device(self) -> float:
        return self.summary.goodput / self.candidate.layout.devices


def candidates(devices: int) -> list[Candidate]:
    if not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"--devices is {devices}; expected 1 to {MAX_DEVICES}")
    out = []
    for chunk in CHUNK_TOKENS:
        out.append(Candidate(Layout(0, devices), chunk, PlacementSettings(DisaggPolicy.NEVER)))
        for prefill in range(1, devices):
            layout = Layout(prefill, devices - prefill)
            out.append(Candidate(layout, chunk, PlacementSettings(DisaggPolicy.ALWAYS)))
            for tokens in LOCAL_PREFILL_TOKENS:
                for delay in LOCAL_PREFILL_QUEUE_DELAYS_S:
                    out.append(Candidate(
                        layout, chunk, PlacementSettings(DisaggPolicy.AUTO, tokens, delay)
                    ))
    return out


def device_costs(profile: Profile, threads: int | None) -> NodeCosts:
    """Every node on its own device: one fitted cost for prefill and decode nodes alike."""
    cost = StepCost.fit(profile.table(threads))
    return NodeCosts(prefill=cost, decode=cost)


def settings_for(candidate: Candidate, profile: Profile) -> SimSettings:
    return SimSettings(
        layout=candidate.layout,
        placement=candidate.placement,
        chunk_tokens=candidate.chunk_tokens,
        kv_capacity_tokens=profile.kv_capacity_tokens,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        transfer_bytes_per_s=profile.transfer_bytes_per_s,
        block_size=profile.block_size,
    )


def search(
    requests: list[SimRequest],
    profile: Profile,
    slo: PlanSlo,
    devices: int,
    threads: int | None = None,
) -> list[Ranked]:
    """Every candidate for `devices`, best first."""
    costs = device_costs(profile, threads)
    ranked = [
        Ranked(c, summarize(simulate(requests, settings_for(c, profile), costs), slo))
        for c in candidates(devices)
    ]
    ranked.sort(key=lambda r: (-r.goodput_per_device, -r.summary.attainment,
                               r.candidate.chunk_tokens))
    return ranked
