"""The requests in flight on the nodes, as the router's node client tracks them: which nodes
serve each, the id the nodes know it by, and its token updates put back in output order.

A request is tracked from `add()` (once its Generate was sent, router/cluster/node_client.py) until
`forget()`: its last token was delivered, it failed, or it was aborted. Until its first token
is delivered (`started`) it waits in the prompt queue of the node computing its prompt
(router/cluster/queue_delay.py); the table takes it out of that queue when it starts, when its attempt
is given up, and when it is forgotten. While the node computes its prompt in chunks, the
node's PromptProgress moves it from waiting to computing there (`progress`).

Shown: a request whose output has not reached its client yet (`shown`, set by the generation
reading its queue, router/generation.py) may be sent again, even when some of its tokens came
back already (their text held back: an incomplete character, a possible stop string). Its
tokens delivered so far are then taken back: `retried()` puts an `AttemptRetried` on its queue,
after which the reader starts the request's output over.

Ids: the nodes know a request by its wire id, the request's own id for the first attempt and
`<id>~<attempt>` for a retry, so nothing of an attempt given up can be mistaken for the
current one: `lookup()` finds the request only under the wire id of its current attempt.

Order: the first token comes from the prefill node and the rest from the decode node, so an
update can arrive ahead of its offset; it waits in the entry's `early` until every update
before it was delivered.

Dependence: a request needs its decode (or colocated) node throughout and its prefill node
until its first token; `lost_with()` names the requests a node's death or restart loses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.queue_delay import PromptQueues
from pdserve.wire.messages import Generate, TokenUpdate


@dataclass
class InFlight:
    """A request sent to `node` (decode or colocated), and to `prefill` in disaggregated mode.

    Updates are delivered to `queue` in output order: one arriving ahead of `next_offset` waits
    in `early`. A retry (router/cluster/node_client.py) sends `request` again under a new `wire_id`, the
    id the nodes then know it by, avoiding the prefill nodes in `failed_prefills` when it can."""

    queue: asyncio.Queue
    node: NodeState
    prefill: NodeState | None = None
    queued_at: NodeState | None = None  # the node computing its prompt, until it starts
    prompt_id: str | None = None  # the id its prompt is computed under, shared with siblings
    started: bool = False  # whether any token (or failure) of this attempt arrived yet
    shown: bool = False  # whether any of its output reached the client: never retried then
    next_offset: int = 0
    early: dict[int, TokenUpdate] = field(default_factory=dict)
    request: Generate | None = None
    wire_id: str | None = None
    attempts: int = 1
    failed_prefills: set[str] = field(default_factory=set)


@dataclass
class AttemptRetried:
    """On a request's queue: every update of it before this one came from an attempt given
    up; its output starts over with the next update."""

    request_id: str


class InFlightTable:
    def __init__(self, prompt_queues: PromptQueues, clock: Callable[[], float]) -> None:
        self.prompt_queues = prompt_queues
        self.clock = clock
        self.entries: dict[str, InFlight] = {}
        self.retry_ids: dict[str, str] = {}  # a retry's wire id -> the request's id
        # a choice group's prompt id -> its choices still waiting for their first token (the
        # first one counts the prompt's tokens)
        self.prompt_ids: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.entries

    def items(self) -> list[tuple[str, InFlight]]:
        """A snapshot: requests may be forgotten or retried while it is walked."""
        return list(self.entries.items())

    @property
    def num_waiting(self) -> int:
        """Requests that have not produced a token yet."""
        return sum(1 for entry in self.entries.values() if not entry.started)

    def add(self, request_id: str, entry: InFlight) -> None:
        self.entries[request_id] = entry

    def sent(
        self,
        request_id: str,
        entry: InFlight,
        node: NodeState,
        prefill: NodeState | None,
        computing: NodeState,
        num_tokens: int,
        prompt_id: str | None = None,
    ) -> None:
        """The request went to `node`, naming `prefill`; it waits in `computing`'s prompt
        queue, with `num_tokens` prompt tokens to compute, until it starts. `prompt_id`: the
        id of the choice group whose prompt this entry counts (router/choice_groups.py)."""
        entry.node, entry.prefill, entry.queued_at = node, prefill, computing
        self.prompt_queues.add(computing, request_id, num_tokens, self.clock())
        if prompt_id is not None:
            entry.prompt_id = prompt_id
            self.prompt_ids.setdefault(prompt_id, []).append(request_id)

    def progress(self, wire_id: str, num_computed: int) -> None:
        """The node computing the prompt sent under `wire_id` (a request's, or a choice
        group's: then each of its choices) has computed `num_computed` of its tokens."""
        for request_id in self.prompt_ids.get(wire_id, [wire_id]):
            found = self.lookup(request_id)
            if found is None:
                continue
            request_id, entry = found
            if not entry.started and entry.queued_at is not None:
                self.prompt_queues.progress(
                    entry.queued_at, request_id, num_computed, self.clock()
                )

    def lookup(self, wire_id: str) -> tuple[str, InFlight] | None:
        """The request a node message is about, unless it is about an attempt given up."""
        request_id = self.retry_ids.get(wire_id, wire_id)
        entry = self.entries.get(request_id)
        if entry is None or (entry.wire_id or request_id) != wire_id:
            return None
        return request_id, entry

    def deliver(self, update: TokenUpdate) -> None:
        """Puts a node's update, and every early one it lets through, on its request's queue
        in output order; the update that finishes the request forgets it."""
        found = self.lookup(update.request_id)
        if found is None or update.offset < found[1].next_offset:
            return  # aborted, unknown, an attempt given up, or already delivered
        request_id, entry = found
        update.request_id = request_id
        entry.early[update.offset] = update
        while entry.next_offset in entry.early:
            ready = entry.early.pop(entry.next_offset)
            self._start(request_id, entry)
            entry.next_offset += len(ready.token_ids)
            entry.queue.put_nowait(ready)
            if ready.finish_reason is not None:
                self.forget(request_id)
                return

    def forget(self, request_id: str) -> InFlight | None:
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return None
        self._leave_prompt(entry, request_id)
        if not entry.started:
            entry.started = True  # no token can reach the client any more
            if entry.queued_at is not None:
                self.prompt_queues.remove(entry.queued_at, request_id, self.clock())
        if entry.wire_id is not None:
            self.retry_ids.pop(entry.wire_id, None)
        return entry

    def give_up_attempt(self, request_id: str, entry: InFlight) -> None:
        """The request's current attempt is lost: its prefill node is one to avoid, and the
        request leaves the prompt queue it waited in."""
        if entry.prefill is not None:
            entry.failed_prefills.add(entry.prefill.address)
        self._leave_prompt(entry, request_id)  # a retried choice is sent alone
        if entry.queued_at is not None:
            self.prompt_queues.remove(entry.queued_at, request_id, self.clock())

    def shown(self, request_id: str) -> None:
        """Some output of the request reached its client: it is never retried from now on."""
        entry = self.entries.get(request_id)
        if entry is not None:
            entry.shown = True

    def retried(self, request_id: str, entry: InFlight, wire_id: str) -> None:
        """The request was sent again as `wire_id`: updates under its old wire id are
        ignored from now on, and those already delivered are taken back."""
        entry.attempts += 1
        if entry.started:
            entry.started = False
            entry.next_offset = 0
            entry.early.clear()
            entry.queue.put_nowait(AttemptRetried(request_id))
        self.retry_ids.pop(entry.wire_id or request_id, None)
        self.retry_ids[wire_id] = request_id
        entry.wire_id = wire_id

    def lost_with(
        self, gone: Callable[[NodeState], bool]
    ) -> Iterator[tuple[str, InFlight, NodeState]]:
        """Each request whose decode (or colocated) node is `gone`, or whose prefill node is
        before its first token, with that node; the caller may retry or forget each one."""
        for request_id, entry in self.items():
            if gone(entry.node):
                yield request_id, entry, entry.node
            elif entry.prefill is not None and not entry.started and gone(entry.prefill):
                yield request_id, entry, entry.prefill

    def _start(self, request_id: str, entry: InFlight) -> None:
        if not entry.started:
            entry.started = True
            self._leave_prompt(entry, request_id)
            if entry.queued_at is not None:
                self.prompt_queues.started(entry.queued_at, request_id, self.clock())

    def _leave_prompt(self, entry: InFlight, request_id: str) -> None:
        """The choice no longer waits for its group's prompt (started, retried alone, gone)."""
        siblings = self.prompt_ids.get(entry.prompt_id) if entry.prompt_id else None
        if siblings is not None:
            siblings.remove(request_id)
            if not siblings:
                del self.prompt_ids[entry.prompt_id]
        entry.prompt_id = None
