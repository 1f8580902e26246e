"""How long a new request would wait before its prompt is computed, per node that computes
prompts (a prefill node, or a colocated node), and the router's early refusal built on it.

The router keeps, per such node, the requests it sent there that have no token back yet,
with their uncached prompt tokens and the time each was sent. Each is in one of two states:
  waiting     sent, not yet computing (queued on the node, or waiting for free KV blocks on a
              decode node: that counts toward its prefill node, it has not started either);
  computing   the node reported a chunk of its prompt computed (PromptProgress): it is being
              served; only its prompt tokens not computed yet still count as backlog.
It leaves at its first token, failure or abort.
A new request's predicted queue delay at a node is the larger of
  backlog     (prompt tokens still to compute + its own) / the node's drain speed, and
  oldest age  how long the oldest request still waiting (not computing) there has waited.
              This term catches every bottleneck the backlog term cannot see (no free decode
              blocks, a slow or stalled node): once the oldest waiter is older than the bound,
              new requests are refused until the queue moves again. A long prompt being
              prefilled for minutes on a busy host is progress, not a stall: it never counts.
The drain speed is what the router observes (`DrainMeter`): prompt tokens computed (reported
chunks, and the rest of a prompt at its first token) per second of time the node's queue was
not empty, over the last `DRAIN_HORIZON_S` seconds of such time. It includes every cost on the
way to the first token (scheduling, transfers, a busy host) and averages over the clusters in
which a batched prefill step starts many requests at once; idle time is no evidence and does not count. Until it has
seen `MIN_DRAIN_TOKENS` start over `MIN_DRAIN_S` of busy time (a few short requests measure
their latency, not the node's throughput), the speed is the one the node measured itself
(NodeStats `scheduling.prefill_tokens_per_s`, from its warm-up and its steps; 0 = not known, and
then the backlog term is 0).
`NodeClient.submit` refuses (429, `QueueDelayBound` in router/cluster/admission.py) a request
whose predicted delay exceeds `max_queue_delay_s`,
before anything is sent, so under any burst a client is told no at once instead of after a
deadline; a request into an empty queue is always admitted (a single long prompt is not
overload). Retries of admitted requests are not judged again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from pdserve.router.cluster.node_registry import NodeState

DRAIN_HORIZON_S = 10.0
MIN_DRAIN_S = 0.5
MIN_DRAIN_TOKENS = 512
MEAN_TOKENS_WEIGHT = 0.05  # of each new prompt in PromptQueues.mean_tokens


@dataclass(frozen=True)
class QueueDelay:
    seconds: float
    queued_tokens: int
    tokens_per_s: float
    oldest_age_s: float

    def describe(self, node: NodeState) -> str:
        name = f"the {node.role or 'unknown'} node {node.node_id or node.address}"
        if self.oldest_age_s >= self.seconds:
            return f"a request has waited {self.oldest_age_s:.1f} s for {name} to start it"
        return (
            f"{name} has {self.queued_tokens:,} prompt tokens queued, about "
            f"{self.seconds:.1f} s of work at its measured {self.tokens_per_s:,.0f} tokens/s"
        )


class DrainMeter:
    """Prompt tokens started per second of busy time, over the last `DRAIN_HORIZON_S` seconds
    of busy time. The span is measured from a start event to now, so the requests one batched
    step starts together are counted with the whole time that step took."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self._events: deque[tuple[float, int]] = deque([(0.0, 0)])  # (busy_s then, tokens)
        self._tokens_after_first = 0

    def advance(self, busy_s: float) -> None:
        """`busy_s` more seconds passed with requests waiting."""
        self.busy_s += busy_s

    def count(self, num_tokens: int) -> None:
        """A request of `num_tokens` prompt tokens started now."""
        self._events.append((self.busy_s, num_tokens))
        self._tokens_after_first += num_tokens
        horizon_start = self.busy_s - DRAIN_HORIZON_S
        while len(self._events) > 2 and self._events[1][0] <= horizon_start:
            self._events.popleft()
            self._tokens_after_first -= self._events[0][1]

    @property
    def tokens_per_s(self) -> float | None:
        span_s = self.busy_s - self._events[0][0]
        if span_s < MIN_DRAIN_S or self._tokens_after_first < MIN_DRAIN_TOKENS:
            return None
        return self._tokens_after_first / span_s


@dataclass
class QueuedPrompt:
    num_tokens: int  # the uncached prompt tokens the router expects the node to compute
    sent_at: float
    num_computed: int = 0  # of those, computed so far (PromptProgress)

    @property
    def num_left(self) -> int:
        return self.num_tokens - self.num_computed


def measured_by_node(node: NodeState) -> float:
    """The prefill speed the node measured over its own steps (NodeStats; 0.0: not yet)."""
    return node.stats.scheduling.prefill_tokens_per_s if node.stats is not None else 0.0


class PromptQueues:
    """Per computing node: its waiting requests (request id -> QueuedPrompt, oldest first),
    its computing ones, and its `DrainMeter`. Every change says when it happened (`now`), so
    the meters count the time each queue was not empty."""

    def __init__(self) -> None:
        self._waiting: dict[str, OrderedDict[str, QueuedPrompt]] = {}
        self._computing: dict[str, dict[str, QueuedPrompt]] = {}
        self._tokens: dict[str, int] = {}
        self._meters: dict[str, DrainMeter] = {}
        self._last_change: dict[str, float] = {}
        self.mean_tokens = 0.0  # of the prompts added lately (a moving average)

    def add(self, node: NodeState, request_id: str, num_tokens: int, now: float) -> None:
        self._advance(node, now)
        weight = MEAN_TOKENS_WEIGHT if self.mean_tokens else 1.0
        self.mean_tokens += weight * (num_tokens - self.mean_tokens)
        waiting = self._waiting.setdefault(node.address, OrderedDict())
        waiting[request_id] = QueuedPrompt(num_tokens, now)
        self._tokens[node.address] = self._tokens.get(node.address, 0) + num_tokens

    def progress(self, node: NodeState, request_id: str, num_computed: int, now: float) -> None:
        """The node has computed `num_computed` of the request's uncached prompt tokens (as
        it reports them; bounded here by what the router counted). The request is computing
        from now on."""
        self._advance(node, now)
        waiting = self._waiting.get(node.address)
        prompt = waiting.pop(request_id, None) if waiting is not None else None
        if prompt is not None:
            self._computing.setdefault(node.address, {})[request_id] = prompt
        else:
            prompt = self._computing.get(node.address, {}).get(request_id)
            if prompt is None:
                return
        done = max(0, min(num_computed, prompt.num_tokens)) - prompt.num_computed
        if done > 0:
            prompt.num_computed += done
            self._tokens[node.address] -= done
            self._meters.setdefault(node.address, DrainMeter()).count(done)

    def started(self, node: NodeState, request_id: str, now: float) -> None:
        """The request's first token came back: its prompt was computed (idempotent)."""
        self._advance(node, now)
        num_tokens = self._pop(node, request_id)
        if num_tokens is not None:
            self._meters.setdefault(node.address, DrainMeter()).count(num_tokens)

    def remove(self, node: NodeState, request_id: str, now: float) -> None:
        """The request failed or was aborted before it started (idempotent): no evidence of
        speed either way."""
        self._advance(node, now)
        self._pop(node, request_id)

    def _advance(self, node: NodeState, now: float) -> None:
        """Counts the time since the queue's last change, if it was not empty meanwhile."""
        last = self._last_change.get(node.address)
        self._last_change[node.address] = now
        if last is not None and self._holds_any(node) and now > last:
            self._meters.setdefault(node.address, DrainMeter()).advance(now - last)

    def _holds_any(self, node: NodeState) -> bool:
        return bool(self._waiting.get(node.address) or self._computing.get(node.address))

    def _pop(self, node: NodeState, request_id: str) -> int | None:
        prompt = None
        for queues in (self._waiting, self._computing):
            queue = queues.get(node.address)
            if queue is not None and prompt is None:
                prompt = queue.pop(request_id, None)
        if prompt is None:
            return None
        self._tokens[node.address] -= prompt.num_left
        return prompt.num_left

    def forget(self, node: NodeState) -> None:
        """The node went down or restarted: its queue is gone (its meter is kept)."""
        self._waiting.pop(node.address, None)
        self._computing.pop(node.address, None)
        self._tokens.pop(node.address, None)
        self._last_change.pop(node.address, None)

    def tokens(self, node: NodeState) -> int:
        return self._tokens.get(node.address, 0)

    def __len__(self) -> int:
        queues = [*self._waiting.values(), *self._computing.values()]
        return sum(len(q) for q in queues)

    def speed(self, node: NodeState) -> float:
        """Prompt tokens per second the node's queue drains at (0.0: not known)."""
        meter = self._meters.get(node.address)
        observed = meter.tokens_per_s if meter is not None else None
        return observed if observed is not None else measured_by_node(node)

    def delay(self, node: NodeState, num_tokens: int, now: float) -> QueueDelay | None:
        """The predicted queue delay of a new request of `num_tokens` at `node`; None when
        nothing waits there (an empty queue always admits)."""
        if not self._holds_any(node):
            return None
        queued = self.tokens(node) + num_tokens
        speed = self.speed(node)
        backlog_s = queued / speed if speed > 0 else 0.0
        waiting = self._waiting.get(node.address)
        oldest_age_s = max(now - next(iter(waiting.values())).sent_at, 0.0) if waiting else 0.0
        return QueueDelay(max(backlog_s, oldest_age_s), queued, speed, oldest_age_s)

    def prompt_speed(self, node: NodeState) -> float:
        """Prompt tokens per second the node computes a prompt at: its own measurement over
        its prefill steps (NodeStats), else its queue's drain speed (0.0: not known). The
        drain speed counts each request's fixed costs too, so short prompts make it low."""
        return measured_by_node(node) or self.speed(node)

    def computed_in_s(
        self, node: NodeState, num_tokens: int, now: float, default_speed: float = 0.0
    ) -> float:
        """Predicted seconds until `node` has computed a new prompt of `num_tokens`: its queue
        (`delay` of what waits there), then the prompt itself at `prompt_speed`
        (`default_speed` where that is not known; nothing where neither is)."""
        queue = self.delay(node, 0, now)
        speed = self.prompt_speed(node) or default_speed
        own_s = num_tokens / speed if speed > 0 else 0.0
        return (queue.seconds if queue is not None else 0.0) + own_s
