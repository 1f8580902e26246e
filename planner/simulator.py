"""A discrete-event simulation of a deployment serving a workload: prefill nodes, decode nodes
(or colocated ones), the router's placement of each prompt, and KV transfers, with step times
from a measured profile.

Life of a request in the simulation (the router's and nodes', docs/design.md):
  arrival      the router picks a decode node (the most free KV tokens, then the fewest
               sequences) and where the prompt is computed: the policy of
               router/cluster/prefill_placement.py, with its thresholds from its own
               PlacementSettings (auto: LOCAL when the decode node lacks at most
               `local_prefill_tokens` of it, or when the prefill node would have computed
               it only after `local_prefill_queue_delay_s` and the decode node sooner);
  LOCAL        the decode node computes the prompt in chunks mixed into its decode steps; its
               first token comes with the step that computes the last chunk;
  REMOTE       the prefill node computes it in chunks (prompts only); each chunk's KV goes to
               the decode node over the link as the chunk finishes (the copy overlaps the next
               chunk; bytes / the profile's transfer bandwidth); the first token comes with the
               last chunk (TTFT does not wait for the transfer); the sequence joins the decode
               node's batch when its last chunk's KV has arrived;
  decoding     one token per step of its node until its output length.
When a node would have computed a prompt mirrors router/cluster/queue_delay.py's
`computed_in_s`: its queue (the larger of its queued prompt tokens / its prefill speed and the
age of the oldest prompt that has not started), then the prompt's own tokens at that speed.
A node's prefix cache holds a shared prefix once it computed it. A decode node that is the only one beside prefill nodes may borrow their cores
while none of them computes (commands/node_threads.py): `NodeCosts.decode_while_prefill_idle`.
Not modelled: preemption, HTTP and detokenization time, the router's own latency.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass

from pdserve.planner.profile_model import StepCost
from pdserve.planner.sim_node import SeqStage, SimNode, SimSequence, Step
from pdserve.planner.workload import SimRequest
from pdserve.router.cluster.prefill_placement import DisaggPolicy, Placement, PlacementSettings


@dataclass(frozen=True)
class Layout:
    prefill_nodes: int
    decode_nodes: int  # colocated nodes when there is no prefill node

    def __post_init__(self) -> None:
        if self.prefill_nodes < 0 or self.decode_nodes < 1:
            raise ValueError(f"a layout needs >= 1 decode node and >= 0 prefill nodes, got "
                             f"{self.prefill_nodes}P{self.decode_nodes}D")

    @property
    def devices(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @property
    def name(self) -> str:
        if self.prefill_nodes == 0:
            return "colocated" if self.decode_nodes == 1 else f"{self.decode_nodes}x colocated"
        return f"{self.prefill_nodes}P{self.decode_nodes}D"


@dataclass(frozen=True)
class NodeCosts:
    prefill: StepCost
    decode: StepCost  # a decode node's, or a colocated node's
    decode_while_prefill_idle: StepCost | None = None


@dataclass(frozen=True)
class SimSettings:
    layout: Layout
    placement: PlacementSettings
    chunk_tokens: int  # max_num_batched_tokens of every node
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    transfer_bytes_per_s: float
    block_size: int = 16
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.layout.prefill_nodes == 0 and self.placement.policy is DisaggPolicy.ALWAYS:
            raise ValueError("policy always needs prefill nodes; a colocated layout computes "
                             "every prompt on its own nodes")
        if self.chunk_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} and max_num_seqs "
                             f"{self.max_num_seqs} must be >= 1")


@dataclass(frozen=True)
class RequestOutcome:
    request: SimRequest
    placement: Placement
    token_times: tuple[float, ...]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.request.arrival_s

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot(self) -> float:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0

    @property
    def finished_s(self) -> float:
        return self.token_times[-1]


def simulate(
    requests: list[SimRequest],
    settings: SimSettings,
    costs: NodeCosts,
    max_concurrency: int | None = None,
) -> list[RequestOutcome]:
    """Every request's outcome, in the order of `requests`. With `max_concurrency`, a request
    is sent at its arrival time or when one of the earlier ones finishes, whichever is later
    (a closed loop: its TTFT counts from when it is sent)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency is {max_concurrency}; expected >= 1")
    return _Cluster(settings, costs, max_concurrency).run(requests)


class _Cluster:
    def __init__(
        self, settings: SimSettings, costs: NodeCosts, max_concurrency: int | None
    ) -> None:
        self.settings, self.costs = settings, costs
        self.free_slots = max_concurrency
        self.held: list[tuple[SimRequest, int]] = []  # arrived, waiting for a free slot
        layout = settings.layout

        def node(name: str, cost: StepCost) -> SimNode:
            return SimNode(name, cost, settings.chunk_tokens, settings.max_num_seqs,
                           settings.kv_capacity_tokens, settings.block_size)

        self.prefill = [node(f"prefill{i}", costs.prefill) for i in range(layout.prefill_nodes)]
        self.decode = [node(f"decode{i}", costs.decode) for i in range(layout.decode_nodes)]
        self.borrows = (
            costs.decode_while_prefill_idle is not None and layout.decode_nodes == 1
            and layout.prefill_nodes > 0
        )
        self.link_free_at = {n.name: 0.0 for n in self.prefill}
        self.remote: dict[int, tuple[SimNode, SimSequence]] = {}  # index -> decode side
        self.placements: dict[int, Placement] = {}
        self.outcomes: dict[int, RequestOutcome] = {}
        self.events: list = []
        self.serial = itertools.count()
        self.now = 0.0
        self.counts: Counter[str] = Counter()

    def run(self, requests: list[SimRequest]) -> list[RequestOutcome]:
        for index, request in enumerate(requests):
            self._at(request.arrival_s, self._arrive, request, index)
        while self.events:
            self.now, _, action, args = heapq.heappop(self.events)
            action(*args)
        return [self.outcomes[i] for i in range(len(requests))]

    def _at(self, when: float, action, *args) -> None:
        heapq.heappush(self.events, (when, next(self.serial), action, args))

    def _arrive(self, request: SimRequest, index: int) -> None:
        if self.free_slots is not None:
            if self.free_slots == 0:
                self.held.append((request, index))
                return
            self.free_slots -= 1
            if self.now > request.arrival_s:  # sent late: its clock starts now
                request = dataclasses.replace(request, arrival_s=self.now)
        decode = max(self.decode, key=lambda n: (n.free_tokens, -n.num_running))
        placement = self._place(decode, request)
        self.placements[index] = placement
        if placement is Placement.LOCAL:
            lacking = request.prompt_tokens - decode.cached_tokens(request)
            decode.admit(SimSequence(request, index, lacking, self.now))
            self._kick(decode)
            return
        prefill = self._pick_prefill(request)
        decode_side = SimSequence(request, index, 0, self.now, SeqStage.TRANSFERRING)
        decode.admit(decode_side)
        self.remote[index] = (decode, decode_side)
        lacking = request.prompt_tokens - prefill.cached_tokens(request)
        prefill.admit(SimSequence(request, index, lacking, self.now))
        self._kick(prefill)

    def _place(self, decode: SimNode, request: SimRequest) -> Placement:
        """router/cluster/prefill_placement.py's rule, on the simulated nodes."""
        policy = self.settings.placement
        if policy.policy is DisaggPolicy.NEVER or not self.prefill:
            return Placement.LOCAL
        if policy.policy is DisaggPolicy.ALWAYS:
            return Placement.REMOTE
        local_tokens = request.prompt_tokens - decode.cached_tokens(request)
        if local_tokens <= policy.local_prefill_tokens:
            return Placement.LOCAL
        prefill = self._pick_prefill(request)
        remote_s = self._computed_in_s(
            prefill, request.prompt_tokens - prefill.cached_tokens(request)
        )
        if (
            remote_s > policy.local_prefill_queue_delay_s
            and self._computed_in_s(decode, local_tokens) < remote_s
        ):
            return Placement.LOCAL
        return Placement.REMOTE

    def _pick_prefill(self, request: SimRequest) -> SimNode:
        """The longest cached prefix, then the fewest queued prompt tokens."""
        return max(self.prefill, key=lambda n: (n.cached_tokens(request), -n.prompt_backlog))

    def _computed_in_s(self, node: SimNode, num_tokens: int) -> float:
        """router/cluster/queue_delay.py's `computed_in_s`: the node's queue (its queued prompt
        tokens at its prefill speed, or the oldest waiting prompt's age where that is longer),
        then the prompt itself at that speed (a lone decode node's with the borrowed cores)."""
        cost = node.cost
        if self.borrows and node in self.decode:
            cost = self.costs.decode_while_prefill_idle
        speed = cost.prefill_tokens_per_s(node.budget)
        queue_s = 0.0
        if node.prompt_backlog:
            oldest = node.oldest_waiting_since()
            age = self.now - oldest if oldest is not None else 0.0
            queue_s = max(node.prompt_backlog / speed, age)
        return queue_s + num_tokens / speed

    def _kick(self, node: SimNode) -> None:
        if node.busy:
            return
        cost = None
        if self.borrows and node in self.decode and not any(p.busy for p in self.prefill):
            cost = self.costs.decode_while_prefill_idle
        step = node.next_step(cost)
        if step is not None:
            node.busy = True
            self._at(self.now + step.seconds, self._step_done, node, step)

    def _step_done(self, node: SimNode, step: Step) -> None:
        node.busy = False
        for seq, tokens in step.chunks:
            seq.prompt_computed += tokens
            if seq.index in self.remote and node in self.prefill:
                self._send_chunk(node, seq, tokens)
            elif seq.prompt_left == 0:
                seq.stage = SeqStage.DECODING
                self._token(node, seq)
        for seq in step.decodes:
            self._token(node, seq)
        self._kick(node)
        if self.borrows and node in self.prefill:
            self._kick(self.decode[0])

    def _send_chunk(self, prefill: SimNode, seq: SimSequence, tokens: int) -> None:
        start = max(self.now, self.link_free_at[prefill.name])
        settings = self.settings
        done = start + tokens * settings.kv_bytes_per_token / settings.transfer_bytes_per_s
        self.link_free_at[prefill.name] = done
        if seq.prompt_left > 0:
            return
        decode, decode_side = self.remote[seq.index]
        decode_side.token_times.append(self.now)  # the first token, from the prefill node
        self._learn_prefix(prefill, seq)
        prefill.finish(seq)
        self._at(done, self._kv_arrived, decode, decode_side)

    def _kv_arrived(self, decode: SimNode, seq: SimSequence) -> None:
        seq.stage = SeqStage.DECODING
        if len(seq.token_times) >= seq.request.output_tokens:
            self._finish(decode, seq)
        self._kick(decode)

    def _token(self, node: SimNode, seq: SimSequence) -> None:
        if not seq.token_times:
            self._learn_prefix(node, seq)
        seq.token_times.append(self.now)
        if len(seq.token_times) >= seq.request.output_tokens:
            self._finish(node, seq)

    def _learn_prefix(self, node: SimNode, seq: SimSequence) -> None:
        if seq.request.prefix_id is not None:
            node.cached_prefixes.add(seq.request.prefix_id)

    def _finish(self, node: SimNode, seq: SimSequence) -> None:
        node.finish(seq)
        self.outcomes[seq.index] = RequestOutcome(
            seq.request, self.placements[seq.index], tuple(seq.token_times)
        )
        if self.free_slots is not None:
            self.free_slots += 1
            if self.held:
                self._arrive(*self.held.pop(0))
