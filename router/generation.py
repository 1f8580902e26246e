"""One API request's generation: `n` node sub-requests (the choices: n per prompt, for each
prompt of a batch, router/api/prompts.py; a prompt's n choices sent in one message, its prompt
computed once, router/choice_groups.py) read from one merged queue, each detokenized
incrementally and cut at its stop strings, yielded as per-choice events.

A choice's first event is the first of its output to reach the client: from then on the node
client never retries it (router/cluster/node_client.py). Before that, a retry may take back the
tokens it delivered (their text held back: an incomplete character, a possible stop string):
an `AttemptRetried` on the queue starts the choice over, and any update of it read together with
and ahead of that marker is dropped unread.

`events()` ends when every choice has finished; its `finally` (and `close()`) aborts every
sub-request still running on the node, so a cancelled stream, a closed generator, a client
disconnect (`ClientDisconnected`, raised once the request's connection reports its client
gone) or a node failure never leaves work behind.

Ownership: whoever calls `start()` must call `close()` once the request is over, whatever
happened (the router registers it with `error_handling.at_request_end` before `start()`). `close()`
is the one place that gives back everything a generation holds, so an exception anywhere
between the admission and the end of the request (in `start()` itself, in a route, in a
response that never ran) cannot leak an admission slot or a node sub-request.

Bounds: each sub-request holds its place in the router's admission queue (admission.py) until
its first token, its end or its abort (`close()` gives back the places of the sub-requests
that never started, submitted or not). The node messages not yet read wait in an
`UpdateQueue`. While the stream's writes to its client are blocked (the client reads slower
than the nodes generate), at most `max_buffer_tokens` tokens may wait there: past that the
generation is aborted on the nodes at once and ends with an error, so the router never holds
more than that for a slow client. (A backlog the router builds while it is merely busy is not
cut: it is bounded by n x max_tokens and drains.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from pdserve.router.api.logprobs import check_prompt_entries
from pdserve.router.api.validation import Plan
from pdserve.router.choice_groups import ChoiceGroup, choice_groups
from pdserve.router.cluster.admission import AdmissionQueue
from pdserve.router.cluster.inflight import AttemptRetried
from pdserve.router.cluster.node_client import NodeClient
from pdserve.router.errors import APIError, ClientDisconnected
from pdserve.router.metrics import RouterMetrics
from pdserve.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.wire.messages import RequestFailed, TokenUpdate


class UpdateQueue(asyncio.Queue):
    """A generation's node messages not yet read. An update that would take the tokens
    waiting past `max_tokens` while `writer_blocked()` says the reader is stuck on its client
    is dropped instead, `overflowed` is set (later updates are dropped too), and `on_overflow`
    runs once, soon (not inside the node client's dispatch that called `put_nowait`).
    Without `writer_blocked` (non-streaming answers) nothing is dropped."""

    def __init__(self, max_tokens: int | None, on_overflow: Callable[[], None]) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.overflowed = False
        self.writer_blocked: Callable[[], bool] | None = None
        self._on_overflow = on_overflow

    def put_nowait(self, item: Any) -> None:
        if self.overflowed:
            return
        tokens = len(getattr(item, "token_ids", ()))
        if (
            self.max_tokens is not None
            and self.num_tokens + tokens > self.max_tokens
            and self.writer_blocked is not None
            and self.writer_blocked()
        ):
            self.overflowed = True
            asyncio.get_running_loop().call_soon(self._on_overflow)
            return
        self.num_tokens += tokens
        super().put_nowait(item)

    def get_nowait(self) -> Any:
        item = super().get_nowait()
        self.num_tokens -= len(getattr(item, "token_ids", ()))
        return item


@dataclass
class ChoiceEvent:
    """New output of one choice; `prompt_logprobs` (with its first token) are the node's
    scores of the choice's prompt, checked against it (router/api/logprobs.py)."""

    index: int
    text: str
    logprobs: list[list[Any]] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[list[Any]] | None = None


@dataclass
class _Choice:
    index: int
    request_id: str
    prompt: list[int]
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    submitted_at: float
    num_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
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
        admission: AdmissionQueue | None = None,
        max_buffer_tokens: int | None = None,
        arrived_at: float | None = None,
    ) -> None:
        self.request_id = request_id
        # When the request reached the router, and when its choices were sent to the nodes
        # (router/metrics.py times a request from these).
        self.arrived_at = time.monotonic() if arrived_at is None else arrived_at
        self.submitted_at: float | None = None
        self.plan = plan
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission
        self.failure: APIError | None = None
        self.queue = UpdateQueue(max_buffer_tokens, self._overflow)
        self.choices: list[_Choice] = []
        self._by_request_id: dict[str, _Choice] = {}
        self._places: dict[int, int] = {}  # choice -> its prompt tokens, while it holds a place
        self._client_gone = False

    @property
    def prompt_tokens(self) -> int:
        """The prompts' tokens, each prompt counted once (not once per choice)."""
        return sum(len(prompt) for prompt in self.plan.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the nodes served from their prefix caches: per prompt, the best of
        its choices."""
        best: dict[int, int] = {}
        for c in self.choices:
            prompt = c.index // self.plan.choices_per_prompt
            best[prompt] = max(best.get(prompt, 0), c.num_cached_tokens)
        return sum(best.values())

    @property
    def first_token_at(self) -> float | None:
        """When the first token of any choice came back."""
        times = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        return min(times, default=None)

    @property
    def finish_reasons(self) -> list[str]:
        """The choices' distinct finish reasons so far, in choice order."""
        reasons = (c.finish_reason for c in sorted(self.choices, key=lambda c: c.index))
        return list(dict.fromkeys(r for r in reasons if r is not None))

    def start(self) -> None:
        """Takes the choices' places in the admission queue (429 when it is full), then
        submits every choice: 503 when no node can take one (SamplingParams bounds every
        number to what the wire carries). Nothing here awaits, so the admission check and the submits happen
        in one event-loop turn. On any error the places taken and the choices already
        submitted stay held until `close()`, which the owner calls in every case."""
        if self.admission is not None:
            lengths = [len(self.plan.prompt_of(i)) for i in range(self.plan.n)]
            self.admission.admit_batch(lengths)
            self._places = dict(enumerate(lengths))
        self.submitted_at = time.monotonic()
        for group in choice_groups(self.request_id, self.plan):  # a prompt's n choices at once
            self._submit(group)
            for index, (sub_id, _) in zip(group.indices, group.choices):
                choice = _Choice(
                    index,
                    sub_id,
                    group.prompt,
                    self._detokenizer(group.prompt),
                    StopStringMatcher(self.plan.stop),
                    self.submitted_at,
                )
                self.choices.append(choice)
                self._by_request_id[sub_id] = choice

    def _submit(self, group: ChoiceGroup) -> None:
        try:
            self.client.submit_choices(
                group.prompt_id, group.prompt, group.choices, self.queue, self.plan.priority,
                self.request_id,
            )
        except KeyError:
            raise  # a bug, not a missing node (KeyError is a LookupError)
        except (LookupError, RuntimeError) as error:
            raise APIError(503, f"No node can take the request now ({error}).") from None

    def close(self) -> None:
        """Aborts every sub-request that has not finished and gives back every admission
        place still held (idempotent, never blocks, never raises)."""
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self.client.abort(choice.request_id)
        for index in list(self._places):
            self._leave_admission(index)

    def _started(self, choice: _Choice) -> None:
        self._leave_admission(choice.index)

    def _leave_admission(self, index: int) -> None:
        """Choice `index` gives back its place in the admission queue (once)."""
        num_tokens = self._places.pop(index, None)
        if num_tokens is not None and self.admission is not None:
            self.admission.leave(num_tokens)

    def _overflow(self) -> None:
        """The client reads slower than the nodes generate and the buffer is full."""
        if self.failure is not None or not self._unfinished():
            return
        self.failure = APIError(
            408,
            f"The client read the stream too slowly: {self.queue.max_tokens:,} tokens were "
            "waiting to be sent, the most the server holds per stream; the request was aborted.",
            code="stream_buffer_full",
            kind="timeout_error",
        )
        self.metrics.error("stream_buffer_full")
        self.close()
        super(UpdateQueue, self.queue).put_nowait(None)  # wakes a reader waiting in _next

    def _unfinished(self) -> bool:
        return any(c.finish_reason is None for c in self.choices)

    async def events(
        self, receive: Receive | None = None, watch_until_first_event: bool = False
    ) -> AsyncIterator[list[ChoiceEvent]]:
        """The choices' events, batched as they arrive. With `receive` (the request's ASGI
        receive, its body already read), a task waits for the connection to report its client
        gone (ClientDisconnected) - until the first event only, with `watch_until_first_event`:
        a streaming response watches its connection from then on. The task costs nothing while
        it waits, however many requests wait for their first token (a poll per request would)."""
        watcher = asyncio.create_task(self._watch(receive)) if receive is not None else None
        try:
            while self._unfinished():
                messages = [await self._next()]
                while not self.queue.empty():
                    messages.append(self.queue.get_nowait())
                events = [e for e in map(self._handle, _current(messages)) if e is not None]
                if events:
                    if watch_until_first_event and watcher is not None:
                        watcher.cancel()
                        watcher = None
                    yield events
            if self.failure is not None:
                raise self.failure
        finally:
            if watcher is not None:
                watcher.cancel()
            self.close()

    async def _watch(self, receive: Receive) -> None:
        """Waits for the client to go away, then wakes the reader."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        super(UpdateQueue, self.queue).put_nowait(None)  # wakes a reader waiting in _next

    async def _next(self) -> Any:
        """The next node message; ClientDisconnected once the client is gone."""
        message = await self.queue.get()
        if self._client_gone:
            raise ClientDisconnected
        return message

    def _handle(self, message: Any) -> ChoiceEvent | None:
        choice = self._by_request_id.get(getattr(message, "request_id", None))
        if choice is None or choice.finish_reason is not None:
            return None
        self._started(choice)
        if isinstance(message, RequestFailed):
            choice.finish_reason = "error"
            raise APIError(message.status, message.message)
        if isinstance(message, AttemptRetried):
            self._start_over(choice)
            return None
        event = self._handle_update(choice, message)
        if event is not None:
            self.client.shown(choice.request_id)
        return event

    def _detokenizer(self, prompt: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt, self.plan.skip_special_tokens)

    def _start_over(self, choice: _Choice) -> None:
        """The choice's tokens so far came from an attempt given up (none of their text was
        shown): its output starts again from nothing."""
        choice.detokenizer = self._detokenizer(choice.prompt)
        choice.matcher = StopStringMatcher(self.plan.stop)
        choice.num_tokens = choice.num_cached_tokens = 0
        choice.first_token_at = choice.last_token_at = None
        choice.text_parts.clear()

    def _handle_update(self, choice: _Choice, update: TokenUpdate) -> ChoiceEvent | None:
        if update.prompt_logprobs is not None:
            prompt = self.plan.prompt_of(choice.index)
            if not check_prompt_entries(update.prompt_logprobs, prompt):
                choice.finish_reason = "error"
                raise APIError(500, "A node sent prompt logprobs that do not fit the prompt.")
        if self.plan.scoring.prompt_only:
            return self._prompt_only(choice, update)
        now = time.monotonic()
        if update.token_ids:
            if choice.last_token_at is None:
                choice.first_token_at = now
                self.metrics.first_token(self.arrived_at, choice.submitted_at, now)
            else:
                self.metrics.later_tokens(now - choice.last_token_at, len(update.token_ids))
            choice.last_token_at = now
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
        if not out and finish is None and not update.logprobs and update.prompt_logprobs is None:
            return None
        return ChoiceEvent(choice.index, out, update.logprobs, finish, update.prompt_logprobs)

    def _prompt_only(self, choice: _Choice, update: TokenUpdate) -> ChoiceEvent:
        """`echo` with `max_tokens: 0` (router/api/echo.py): the choice ends at its first update;
        the token the node was asked for is dropped, and the node stops if it has not."""
        now = time.monotonic()
        choice.first_token_at = now
        self.metrics.first_token(self.arrived_at, choice.submitted_at, now)
        if update.finish_reason is None:
            self.client.abort(choice.request_id)
        self._finish(choice, "length", now)
        return ChoiceEvent(choice.index, "", None, "length", update.prompt_logprobs)

    def _finish(self, choice: _Choice, reason: str, now: float) -> None:
        choice.finish_reason = reason
        self.metrics.choice_finished(
            reason, self.arrived_at, choice.submitted_at, choice.first_token_at,
            choice.num_tokens, now,
        )


def _current(messages: list[Any]) -> list[Any]:
    """The messages without the updates of attempts given up: those ahead of an
    AttemptRetried of the same request."""
    retried_at = {
        m.request_id: i for i, m in enumerate(messages) if isinstance(m, AttemptRetried)
    }
    return [
        m for i, m in enumerate(messages)
        if i >= retried_at.get(getattr(m, "request_id", None), -1)
    ]
