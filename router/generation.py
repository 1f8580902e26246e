"""One API request's generation: `n` node sub-requests read from one merged queue, each
detokenized incrementally and cut at its stop strings, yielded as per-choice events.

`events()` ends when every choice has finished; its `finally` (and `close()`) aborts every
sub-request still running on the node, so a cancelled stream, a closed generator, a client
disconnect (`ClientDisconnected`, raised when the optional `poll_disconnect` says so) or a
node failure never leaves work behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.protocol import RequestFailed, TokenUpdate
from router.errors import APIError
from router.metrics import RouterMetrics
from router.node_client import NodeClient
from router.validation import Plan

DISCONNECT_POLL_S = 0.05


class ClientDisconnected(Exception):
    """The client went away while its request was running."""


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[list[Any]] | None = None
    finish_reason: str | None = None


@dataclass
class _Choice:
    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    submitted_at: float
    num_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)


class Generation:
    def __init__(
        self,
        request_id: str,
        plan: Plan,
        client: NodeClient,
        tokenizer: Any,
        metrics: RouterMetrics,
    ) -> None:
        self.request_id = request_id
        self.plan = plan
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self._by_request_id: dict[str, _Choice] = {}
        self.poll_disconnect: Callable[[], Awaitable[bool]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.plan.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the node served from its prefix cache (the best of the n choices)."""
        return max((c.num_cached_tokens for c in self.choices), default=0)

    def start(self) -> None:
        """Submits every choice; 503 (after aborting those already sent) if one fails."""
        for index, sampling in enumerate(self.plan.samplings):
            sub_id = f"{self.request_id}-{index}"
            try:
                self.client.submit(sub_id, self.plan.prompt_ids, sampling, self.queue)
            except (LookupError, RuntimeError) as error:
                self.close()
                raise APIError(503, f"No node can take the request now ({error}).") from None
            choice = _Choice(
                index,
                sub_id,
                IncrementalDetokenizer(
                    self.tokenizer, self.plan.prompt_ids, self.plan.skip_special_tokens
                ),
                StopStringMatcher(self.plan.stop),
                time.monotonic(),
            )
            self.choices.append(choice)
            self._by_request_id[sub_id] = choice

    def close(self) -> None:
        """Aborts every sub-request that has not finished (idempotent, never blocks)."""
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self.client.abort(choice.request_id)

    def _unfinished(self) -> bool:
        return any(c.finish_reason is None for c in self.choices)

    async def events(self) -> AsyncIterator[list[ChoiceEvent]]:
        try:
            while self._unfinished():
                messages = [await self._next()]
                while not self.queue.empty():
                    messages.append(self.queue.get_nowait())
                events = [e for e in map(self._handle, messages) if e is not None]
                if events:
                    yield events
        finally:
            self.close()

    async def _next(self) -> Any:
        while True:
            poll = self.poll_disconnect
            if poll is None:
                return await self.queue.get()
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await poll():
                    raise ClientDisconnected from None

    def _handle(self, message: Any) -> ChoiceEvent | None:
        choice = self._by_request_id.get(message.request_id)
        if choice is None or choice.finish_reason is not None:
            return None
        if isinstance(message, RequestFailed):
            choice.finish_reason = "error"
            raise APIError(message.status, message.message)
        return self._handle_update(choice, message)

    def _handle_update(self, choice: _Choice, update: TokenUpdate) -> ChoiceEvent | None:
        now = time.monotonic()
        if update.token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.metrics.time_to_first_token.observe(now - choice.submitted_at)
            choice.num_tokens += len(update.token_ids)
            choice.num_cached_tokens = update.num_cached_tokens
            self.metrics.generation_tokens.inc(len(update.token_ids))
        text = choice.detokenizer.add(update.token_ids)
        if update.finish_reason is not None:
            text += choice.detokenizer.flush()
        out, stopped = choice.matcher.feed(text)
        finish = None
        if stopped:
            finish = "stop"
            if update.finish_reason is None:
                self.client.abort(choice.request_id)
        elif update.finish_reason is not None:
            out += choice.matcher.flush()
            finish = update.finish_reason
        if finish is not None:
            self._finish(choice, finish, now)
        choice.text_parts.append(out)
        if not out and finish is None and not update.logprobs:
            return None
        return ChoiceEvent(choice.index, out, update.logprobs, finish)

    def _finish(self, choice: _Choice, reason: str, now: float) -> None:
        choice.finish_reason = reason
        self.metrics.request_success.labels(reason).inc()
        if choice.first_token_at is not None and choice.num_tokens > 1:
            self.metrics.time_per_output_token.observe(
                (now - choice.first_token_at) / (choice.num_tokens - 1)
            )
