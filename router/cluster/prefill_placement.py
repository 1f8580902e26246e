"""Where the prompt of a request sent to a decode node is computed (conditional disaggregation).

  REMOTE  a prefill node computes it and writes its KV into the decode node's reserved blocks
          (the Generate names that prefill node);
  LOCAL   the decode node computes it itself, in chunks mixed into its decode steps under its
          token budget (`--max-num-batched-tokens`), as a colocated node does (the Generate
          names no prefill node).

Disaggregation pays for long prompts under load and costs for short ones: a short prompt's
KV transfer and extra hop cost more than the interference its prefill would cause among the
decode node's streams. The policy (`--disagg-policy`):
  always  REMOTE, whenever a prefill node is alive; without one, decode nodes take no
          requests
  never   LOCAL: decode nodes serve as colocated nodes; prefill nodes stay idle
  auto    (the default) per request, the first rule that holds (the reason is counted with
          the choice):
            no prefill node is alive                                  LOCAL   no_prefill_node
            its tokens the decode node lacks <= local_prefill_tokens  LOCAL   short_prompt
            the chosen prefill node would have computed it only after
            more than local_prefill_queue_delay_s, and the decode node
            sooner                                                     LOCAL   prefill_queue
            otherwise                                                  REMOTE  long_prompt
The tokens a node lacks are the prompt less its longest prefix that node likely has cached,
from the router's prefix index (router/cluster/routing.py), which learns the prompts computed
on decode nodes as it learns those sent to prefill nodes. When a node would have computed a
prompt is the router's prediction (`PromptQueues.computed_in_s`,
router/cluster/queue_delay.py): its queue at the speed it drains at, then the prompt itself
at the speed the node measured. The prompt itself counts: where a prefill node is slower than
the decode node (on a CPU host whose cores the two share, the decode node has them all while
no prompt is being prefilled) a long prompt into an empty prefill queue is still computed
sooner on the decode node. Every choice is counted by placement and reason
(`pdserve_prefill_placements_total`).

Why auto by default: on one mixed, bursty workload (bench/results/goodput.md; 2 CPU cores)
1P1D with auto reached 0.96-1.05x colocated's goodput at every load, where 1P1D computing
every prompt on its prefill node reached 0.24-0.91x.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.queue_delay import PromptQueues
from pdserve.router.cluster.routing import PrefillRouter


class DisaggPolicy(enum.StrEnum):
    ALWAYS = "always"
    NEVER = "never"
    AUTO = "auto"


class Placement(enum.StrEnum):
    REMOTE = "remote"
    LOCAL = "local"


@dataclass(frozen=True)
class PlacementSettings:
    """The operator's choice (RouterConfig's `disagg_policy`, `local_prefill_tokens`,
    `local_prefill_queue_delay_s`, whose defaults these are)."""

    policy: DisaggPolicy = DisaggPolicy.AUTO
    local_prefill_tokens: int = 512
    local_prefill_queue_delay_s: float = 1.0


@dataclass(frozen=True)
class PlacementChoice:
    placement: Placement
    reason: str
    prefill: NodeState | None  # the prefill node computing the prompt (REMOTE only)
    num_tokens: int  # the prompt tokens the computing node likely lacks


class PrefillPlacement:
    def __init__(
        self,
        settings: PlacementSettings,
        prefill_router: PrefillRouter,
        queues: PromptQueues,
        clock: Callable[[], float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.policy = DisaggPolicy(settings.policy)
        self.local_prefill_tokens = settings.local_prefill_tokens
        self.local_prefill_queue_delay_s = settings.local_prefill_queue_delay_s
        self.prefill_router = prefill_router
        self.queues = queues
        self.clock = clock
        self._counter = None
        if registry is not None:
            self._counter = Counter(
                "pdserve_prefill_placements",
                "Prompts sent to decode nodes, by where they were computed and why",
                ["placement", "reason"],
                registry=registry,
            )

    @property
    def needs_prefill_nodes(self) -> bool:
        """Whether decode nodes take requests only while a prefill node is alive."""
        return self.policy is DisaggPolicy.ALWAYS

    def candidates(self, decode_node: NodeState, prefill_nodes: list[NodeState]) -> list[NodeState]:
        """The nodes that may compute a prompt sent to `decode_node`."""
        if self.policy is DisaggPolicy.ALWAYS:
            return prefill_nodes
        if self.policy is DisaggPolicy.NEVER:
            return [decode_node]
        return [*prefill_nodes, decode_node]

    def place(
        self, decode_node: NodeState, prefill_nodes: list[NodeState], prompt: list[int]
    ) -> PlacementChoice:
        """Where the prompt of a request sent to `decode_node` is computed, among the live
        `prefill_nodes` (those it has not failed on first, the caller's choice)."""
        choice = self._choose(decode_node, prefill_nodes, prompt)
        if self._counter is not None:
            self._counter.labels(choice.placement.value, choice.reason).inc()
        return choice

    def _choose(
        self, decode_node: NodeState, prefill_nodes: list[NodeState], prompt: list[int]
    ) -> PlacementChoice:
        if self.policy is DisaggPolicy.NEVER:
            return self._local(decode_node, prompt, "policy")
        if not prefill_nodes:
            return self._local(decode_node, prompt, "no_prefill_node")
        if self.policy is DisaggPolicy.ALWAYS:
            return self._remote(prefill_nodes, prompt, "policy")
        local = self._local(decode_node, prompt, "short_prompt")
        if local.num_tokens <= self.local_prefill_tokens:
            return local  # the prefill nodes' index is not even read
        remote = self._remote(prefill_nodes, prompt, "long_prompt")
        now = self.clock()
        remote_s = self.queues.computed_in_s(remote.prefill, remote.num_tokens, now)
        if remote_s > self.local_prefill_queue_delay_s:
            # A decode node that has computed no prompt yet is taken to be as fast as the
            # prefill node: only the queues then tell them apart.
            local_s = self.queues.computed_in_s(
                decode_node, local.num_tokens, now, self.queues.prompt_speed(remote.prefill)
            )
            if local_s < remote_s:
                return PlacementChoice(Placement.LOCAL, "prefill_queue", None, local.num_tokens)
        return remote

    def _local(self, decode_node: NodeState, prompt: list[int], reason: str) -> PlacementChoice:
        cached = self.prefill_router.cached_tokens(decode_node, prompt)
        return PlacementChoice(Placement.LOCAL, reason, None, len(prompt) - cached)

    def _remote(
        self, prefill_nodes: list[NodeState], prompt: list[int], reason: str
    ) -> PlacementChoice:
        prefill, cached = self.prefill_router.pick(prefill_nodes, prompt)
        return PlacementChoice(Placement.REMOTE, reason, prefill, len(prompt) - cached)
