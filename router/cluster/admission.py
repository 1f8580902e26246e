"""The router's admission queue: sub-requests it accepted that have not started yet (no token
back from a node, so they wait for KV blocks, a prefill node or a transfer), counted with
their prompt tokens.

Two checks, both answered 429 with an OpenAI error body and `Retry-After`:
  check_room()  first thing in a generation route, before the body is read, parsed or
                tokenized: is the queue already at one of its bounds? (cheap rejection under
                overload)
  admit(n, k)   after tokenization, in the same event-loop turn as the submit (no await in
                between, so concurrent requests cannot all squeeze past the bound): would n
                more sub-requests of k prompt tokens each pass a bound? A request that alone
                exceeds the token bound is admitted only into an empty queue. `admit_batch`
                does the same for sub-requests of different prompts (a batch of prompts).
Each admitted sub-request leaves the queue once (`leave`) at its first token, its end or its
abort, whichever comes first. `/tokenize` and `/detokenize` pass the same checks and hold one
place while their tokenizer job runs (`holding`), so they cannot flood the tokenizer threads
past the bounds generation requests keep. The bounds are read from the config at every check.

The router's other 429, the queue-delay bound, lives here too (`QueueDelayBound`): NodeClient
asks it before a request is read (`check_nodes`, through `NodeClient.check_overload`) and at
submit, for the node that computes the prompt (`check_node`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge

from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.queue_delay import PromptQueues, QueueDelay
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError


class AdmissionQueue:
    def __init__(self, config: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.num_requests = 0
        self.num_tokens = 0
        self._gauges = None
        if registry is not None:
            self._gauges = (
                Gauge(
                    "pdserve_router_queued_requests",
                    "Sub-requests admitted by the router and not started yet",
                    registry=registry,
                ),
                Gauge(
                    "pdserve_router_queued_tokens",
                    "Prompt tokens of the sub-requests admitted and not started yet",
                    registry=registry,
                ),
            )

    def check_room(self) -> None:
        config = self.config
        if self.num_requests >= config.max_queued_requests:
            raise self._busy(f"{self.num_requests:,} requests are queued")
        if self.num_tokens >= config.max_queued_tokens:
            raise self._busy(f"{self.num_tokens:,} prompt tokens are queued")

    def admit(self, num_requests: int, num_prompt_tokens: int) -> None:
        self.admit_batch([num_prompt_tokens] * num_requests)

    def admit_batch(self, prompt_lengths: list[int]) -> None:
        """As `admit`, for sub-requests of different prompt lengths (one length each)."""
        config = self.config
        num_requests = len(prompt_lengths)
        tokens = sum(prompt_lengths)
        if self.num_requests + num_requests > config.max_queued_requests:
            raise self._busy(
                f"{self.num_requests:,} requests are queued and this one adds {num_requests}"
            )
        if self.num_requests and self.num_tokens + tokens > config.max_queued_tokens:
            raise self._busy(
                f"{self.num_tokens:,} prompt tokens are queued and this request adds {tokens:,}"
            )
        self.num_requests += num_requests
        self.num_tokens += tokens
        self._publish()

    @contextlib.contextmanager
    def holding(self, num_prompt_tokens: int = 0) -> Iterator[None]:
        """One place in the queue for the duration of the block (429 when there is none)."""
        self.admit(1, num_prompt_tokens)
        try:
            yield
        finally:
            self.leave(num_prompt_tokens)

    def leave(self, num_prompt_tokens: int) -> None:
        self.num_requests -= 1
        self.num_tokens -= num_prompt_tokens
        self._publish()

    def _publish(self) -> None:
        if self._gauges is not None:
            self._gauges[0].set(self.num_requests)
            self._gauges[1].set(self.num_tokens)

    def _busy(self, what: str) -> APIError:
        config = self.config
        return APIError(
            429,
            f"The server is overloaded: {what} (limits: {config.max_queued_requests:,} requests, "
            f"{config.max_queued_tokens:,} prompt tokens). Try again later.",
            code="rate_limit_exceeded",
        )


class QueueDelayBound:
    """429 for a prompt whose predicted queue delay (router/cluster/queue_delay.py) exceeds
    `max_queue_delay_s`; no bound when it is None."""

    def __init__(
        self,
        max_queue_delay_s: float | None,
        prompt_queues: PromptQueues,
        clock: Callable[[], float],
    ) -> None:
        self.max_queue_delay_s = max_queue_delay_s
        self.prompt_queues = prompt_queues
        self.clock = clock

    def check_nodes(self, candidates: list[NodeState], num_arriving: int) -> None:
        """429 when every candidate node predicts a delay past the bound for the requests
        ahead: those queued there, and `num_arriving` more, each counted as the mean prompt of
        recent submits, spread over the candidates."""
        if self.max_queue_delay_s is None:
            return
        now = self.clock()
        ahead = round(num_arriving * self.prompt_queues.mean_tokens / max(len(candidates), 1))
        delays = [(self.prompt_queues.delay(n, ahead, now), n) for n in candidates]
        if delays and all(d is not None and d.seconds > self.max_queue_delay_s for d, _ in delays):
            delay, least_loaded = min(delays, key=lambda pair: pair[0].seconds)
            raise self._overloaded(least_loaded, delay)

    def check_node(self, node: NodeState, num_tokens: int) -> None:
        """429 when `node` predicts a delay past the bound for a prompt of `num_tokens`."""
        if self.max_queue_delay_s is None:
            return
        delay = self.prompt_queues.delay(node, num_tokens, self.clock())
        if delay is not None and delay.seconds > self.max_queue_delay_s:
            raise self._overloaded(node, delay)

    def _overloaded(self, node: NodeState, delay: QueueDelay) -> APIError:
        return APIError(
            429,
            f"The server is overloaded: {delay.describe(node)}, more than the "
            f"{self.max_queue_delay_s:g} s a request may wait to start. Try again later.",
            code="rate_limit_exceeded",
        )
