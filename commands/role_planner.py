"""The run-time planner's policies: from a snapshot of the router's signals, whether to turn
one node into another role, and which. `--planner load` (`LoadPolicy`, here) reads queues and
KV usage; `--planner slo` (`SloPolicy`, commands/slo_policy.py) reads SLO attainment.

Pure: `decide(signals)` reads only the snapshot it is given (with its time) and what the policy
remembers of earlier snapshots; it sends nothing and starts nothing. The launcher's role
changer (commands/role_changer.py) reads the signals from the router (GET /admin/nodes,
router/api/admin.py), asks, and carries a decision out.

Signals, over the nodes that serve (live, not draining):
  prefill queue delay  the largest predicted queue delay of the prefill nodes
                       (router/cluster/queue_delay.py: the wait a new prompt would have)
  decode KV usage      the decode nodes' mean fraction of KV blocks in use
  decode waiting       the requests waiting per decode node (for KV blocks, or for prompts
                       they compute themselves)
  recent choices       each choice the router finished lately: its age, TTFT and TPOT
                       (router/recent_latencies.py)
Rules of `--planner load` (thresholds: commands/planner_settings.py):
  prefill queue delay >= prefill_delay_high and decode KV usage <= planner_kv_usage_low
      -> a decode node becomes a prefill node                         reason prefill_queue
  (decode KV usage >= planner_kv_usage_high or decode waiting >= planner_decode_waiting_high)
  and prefill queue delay <= prefill_delay_low
      -> a prefill node becomes a decode node                 reason decode_kv / decode_queue
Against flapping, for every policy (`RolePolicy`):
  hysteresis  each threshold is a high/low pair and the two rules ask for opposite ends, so
              no snapshot satisfies both, and a change does not undo itself unless the load
              really moved to the other side;
  sustain     a rule acts only once it has held at every snapshot for `planner_sustain_s`;
  dwell       nothing changes within `planner_min_dwell_s` of the planner's start or of its last
              change (`changed()`), nor while any node is down or draining (a change or a
              restart is under way).
Floor: at least one prefill node and one decode node always serve; a change never takes the
last of either. The node taken is the one with the least work (the quickest to drain).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.commands.planner_settings import PlannerSettings
from pdserve.wire.roles import Role


class ChangeReason(enum.StrEnum):
    PREFILL_QUEUE = "prefill_queue"
    DECODE_KV = "decode_kv"
    DECODE_QUEUE = "decode_queue"
    TTFT_SLO = "ttft_slo"
    ITL_SLO = "itl_slo"


@dataclass(frozen=True)
class NodeSignals:
    """One node as GET /admin/nodes describes it (router/api/admin.py)."""

    node_id: str
    role: str
    live: bool
    state: str  # serving | draining | empty (router/cluster/node_drain.py)
    held: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    queue_delay_s: float = 0.0

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> NodeSignals:
        """ValueError for an entry that is not the router's node description."""
        try:
            node = cls(
                node_id=str(entry["node_id"]), role=str(entry["role"]), live=bool(entry["live"]),
                state=str(entry["state"]), held=int(entry["held"]),
                num_waiting=int(entry["num_waiting"]), num_running=int(entry["num_running"]),
                kv_free_blocks=int(entry["kv_free_blocks"]),
                kv_total_blocks=int(entry["kv_total_blocks"]),
                queue_delay_s=float(entry["queue_delay_s"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a node entry of the router is malformed: {error!r}") from None
        return node

    @property
    def serving(self) -> bool:
        return self.live and self.state == "serving"

    @property
    def kv_usage(self) -> float:
        total = self.kv_total_blocks
        return (total - self.kv_free_blocks) / total if total > 0 else 0.0

    @property
    def work(self) -> int:
        return self.held + self.num_waiting + self.num_running


@dataclass(frozen=True)
class RecentChoice:
    """A choice the router finished `age_s` ago (router/recent_latencies.py); `tpot_s` is none
    for a single-token choice."""

    age_s: float
    ttft_s: float
    tpot_s: float | None

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> RecentChoice:
        """ValueError for an entry that is not the router's description of a choice."""
        try:
            tpot = entry["tpot_s"]
            choice = cls(float(entry["age_s"]), float(entry["ttft_s"]),
                         None if tpot is None else float(tpot))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a recent choice of the router is malformed: {error!r}") from None
        return choice


@dataclass(frozen=True)
class ClusterSignals:
    """A snapshot of every node the router knows, and of the choices it finished lately, taken
    at `now` (the launcher's clock)."""

    now: float
    nodes: tuple[NodeSignals, ...]
    recent: tuple[RecentChoice, ...] = ()

    def serving(self, role: Role) -> list[NodeSignals]:
        return [node for node in self.nodes if node.role == role and node.serving]

    @property
    def settled(self) -> bool:
        """Every node known serves: none down, restarting, or draining."""
        return all(node.serving for node in self.nodes)

    @property
    def prefill_queue_delay_s(self) -> float:
        return max((n.queue_delay_s for n in self.serving(Role.PREFILL)), default=0.0)

    @property
    def decode_kv_usage(self) -> float:
        decode = self.serving(Role.DECODE)
        return sum(n.kv_usage for n in decode) / len(decode) if decode else 0.0

    @property
    def decode_waiting(self) -> float:
        decode = self.serving(Role.DECODE)
        return sum(n.num_waiting for n in decode) / len(decode) if decode else 0.0

    def describe(self) -> str:
        return (
            f"prefill queue delay {self.prefill_queue_delay_s:.2f} s, decode KV usage "
            f"{self.decode_kv_usage:.2f}, decode waiting {self.decode_waiting:.1f}/node, "
            f"{len(self.serving(Role.PREFILL))} prefill + {len(self.serving(Role.DECODE))} decode"
        )


@dataclass(frozen=True)
class RoleChange:
    node_id: str
    from_role: Role
    to_role: Role
    reason: ChangeReason
    signals: str  # the snapshot that decided it, in words

    def describe(self) -> str:
        return (
            f"node {self.node_id}: {self.from_role} -> {self.to_role} "
            f"(reason {self.reason}; {self.signals})"
        )


@dataclass(frozen=True)
class Wish:
    """The change a policy asks for, before sustain, dwell and the floor allow it."""

    from_role: Role
    to_role: Role
    reason: ChangeReason


class RolePolicy:
    """What every policy shares (module docstring): sustain, dwell, the floor and the choice of
    node. A policy says only which change it wishes for a snapshot (`_wish_of`) and how it
    describes that snapshot (`_describe`). `started_at`: when the planner began (the first
    dwell runs from it)."""

    def __init__(self, settings: PlannerSettings, started_at: float) -> None:
        self.settings = settings
        self.last_change_at = started_at
        self._wish: Wish | None = None
        self._wish_since = 0.0

    def changed(self, now: float) -> None:
        """A change was carried out (or given up) at `now`: the dwell starts again."""
        self.last_change_at = now
        self._wish = None

    def decide(self, signals: ClusterSignals) -> RoleChange | None:
        wish = self._wish_of(signals)
        if wish != self._wish:
            self._wish, self._wish_since = wish, signals.now
        if wish is None or not signals.settled:
            return None
        now = signals.now
        if now - self._wish_since < self.settings.planner_sustain_s:
            return None
        if now - self.last_change_at < self.settings.planner_min_dwell_s:
            return None
        candidates = signals.serving(wish.from_role)
        if len(candidates) < 2:  # the floor: one node of each role serves
            return None
        node = min(candidates, key=lambda n: (n.work, n.kv_usage, n.node_id))
        return RoleChange(
            node.node_id, wish.from_role, wish.to_role, wish.reason, self._describe(signals)
        )

    def _wish_of(self, signals: ClusterSignals) -> Wish | None:
        raise NotImplementedError

    def _describe(self, signals: ClusterSignals) -> str:
        return signals.describe()


class LoadPolicy(RolePolicy):
    """`--planner load` (module docstring)."""

    def _wish_of(self, signals: ClusterSignals) -> Wish | None:
        s = self.settings
        delay = signals.prefill_queue_delay_s
        usage = signals.decode_kv_usage
        if delay >= s.planner_prefill_delay_high_s and usage <= s.planner_kv_usage_low:
            return Wish(Role.DECODE, Role.PREFILL, ChangeReason.PREFILL_QUEUE)
        if delay <= s.planner_prefill_delay_low_s:
            if usage >= s.planner_kv_usage_high:
                return Wish(Role.PREFILL, Role.DECODE, ChangeReason.DECODE_KV)
            if signals.decode_waiting >= s.planner_decode_waiting_high:
                return Wish(Role.PREFILL, Role.DECODE, ChangeReason.DECODE_QUEUE)
        return None
