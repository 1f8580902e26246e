"""How long a new request would wait before its prompt is computed, per node that computes
prompts (a prefill node, or a colocated node), and the router's early refusal built on it.

The router keeps, per such node, the requests it sent there that have not started yet (no
token back) with their uncached prompt tokens and the time each was sent. A request waiting
for free KV blocks on a decode node counts toward its prefill node: it has not started either.
A new request's predicted queue delay at a node is the larger of
  backlog     (queued prompt tokens + its own) / the node's drain speed, and
  oldest age  how long the oldest request still waiting there has waited. This term catches
              every bottleneck the backlog term cannot see (no free decode blocks, a slow or
              stalled node): once the oldest waiter is older than the bound, new requests are
              refused until the queue moves again.
The drain speed is what the router observes: prompt tokens of the requests that started per
second while the node's queue stayed non-empty, over windows of at least `MIN_WINDOW_S`, as an
exponential moving average; it includes every cost on the way to the first token (scheduling,
transfers, a busy host). Until a window has been observed it is the prefill speed the node
measured itself (NodeStats `prefill_tokens_per_s`, from its warm-up and its steps; 0 = not
known, and then the backlog term is 0).
`NodeClient.submit` refuses (429) a request whose predicted delay exceeds `max_queue_delay_s`,
before anything is sent, so under any burst a client is told no at once instead of after a
deadline; a request into an empty queue is always admitted (a single long prompt is not
overload). Retries of admitted requests are not judged again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from router.node_registry import NodeState

MIN_WINDOW_S = 0.25
SMOOTHING = 0.3


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


class PromptQueues:
    """Per computing node: request id -> (uncached prompt tokens, time sent), oldest first,
    and the node's observed drain speed."""

    def __init__(self) -> None:
        self._queues: dict[str, OrderedDict[str, tuple[int, float]]] = {}
        self._tokens: dict[str, int] = {}
        self._windows: dict[str, tuple[float, int]] = {}  # window start, tokens drained since
        self._drain_speed: dict[str, float] = {}

    def add(self, node: NodeState, request_id: str, num_tokens: int, now: float) -> None:
        queue = self._queues.setdefault(node.address, OrderedDict())
        if not queue:
            self._windows[node.address] = (now, 0)
        queue[request_id] = (num_tokens, now)
        self._tokens[node.address] = self._tokens.get(node.address, 0) + num_tokens

    def started(self, node: NodeState, request_id: str, now: float) -> None:
        """The request's first token came back: its prompt was computed (idempotent)."""
        num_tokens = self._pop(node, request_id)
        window = self._windows.get(node.address)
        if num_tokens is None or window is None:
            return
        window_start, drained = window[0], window[1] + num_tokens
        if now - window_start >= MIN_WINDOW_S:
            measured = drained / (now - window_start)
            previous = self._drain_speed.get(node.address)
            self._drain_speed[node.address] = (
                measured if previous is None else SMOOTHING * measured + (1 - SMOOTHING) * previous
            )
            window_start, drained = now, 0
        self._windows[node.address] = (window_start, drained)
        if not self._queues[node.address]:
            del self._windows[node.address]  # idle time is no evidence of speed

    def remove(self, node: NodeState, request_id: str) -> None:
        """The request failed or was aborted before it started (idempotent)."""
        self._pop(node, request_id)
        if not self._queues.get(node.address):
            self._windows.pop(node.address, None)

    def _pop(self, node: NodeState, request_id: str) -> int | None:
        queue = self._queues.get(node.address)
        entry = queue.pop(request_id, None) if queue is not None else None
        if entry is None:
            return None
        self._tokens[node.address] -= entry[0]
        return entry[0]

    def forget(self, node: NodeState) -> None:
        """The node went down or restarted: its queue is gone (its speed is kept)."""
        self._queues.pop(node.address, None)
        self._tokens.pop(node.address, None)
        self._windows.pop(node.address, None)

    def tokens(self, node: NodeState) -> int:
        return self._tokens.get(node.address, 0)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def speed(self, node: NodeState) -> float:
        """Prompt tokens per second the node's queue drains at (0.0: not known)."""
        observed = self._drain_speed.get(node.address)
        if observed is not None:
            return observed
        return node.stats.prefill_tokens_per_s if node.stats is not None else 0.0

    def delay(self, node: NodeState, num_tokens: int, now: float) -> QueueDelay | None:
        """The predicted queue delay of a new request of `num_tokens` at `node`; None when
        nothing waits there (an empty queue always admits)."""
        queue = self._queues.get(node.address)
        if not queue:
            return None
        queued = self.tokens(node) + num_tokens
        speed = self.speed(node)
        backlog_s = queued / speed if speed > 0 else 0.0
        oldest_age_s = max(now - next(iter(queue.values()))[1], 0.0)
        return QueueDelay(max(backlog_s, oldest_age_s), queued, speed, oldest_age_s)
