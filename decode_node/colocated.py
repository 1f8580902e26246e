"""The colocated node: one process, one LLMEngine, prefill and decode together, over ZeroMQ.

Sockets (addresses come from the constructor; nothing is module-global):
  PULL, bound at `listen_address`    <- router: Generate, Abort (msgpack, `engine.protocol`)
  PUSH, connected to `router_address` -> router: TokenBatch, RequestFailed, NodeStats

Loop (`run()` until `stop()`):
  1. poll the PULL socket: timeout 0 while the engine has work, else IDLE_POLL_MS, so the step
     loop never blocks on I/O; then drain every pending message. Generate -> SamplingParams and
     engine.add_request (ValueError/TypeError, duplicate ids included, -> RequestFailed 400);
     Abort -> engine.abort_request (unknown ids ignored); malformed or unexpected messages are
     logged in one line (no payload echo) and dropped.
  2. one engine.step(); if it produced outputs, ONE TokenBatch with a TokenUpdate per request.
     An exception while stepping is logged, every in-flight request gets RequestFailed 500 and
     is aborted, and the loop goes on.
  3. NodeStats right after startup (the "ready" signal) and every `heartbeat_interval` seconds.
Sends never block: results that the PUSH socket cannot take now wait in an outbox (in order)
and are retried every iteration; heartbeats are skipped while the outbox is not empty.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.protocol import (
    Abort,
    Generate,
    NodeStats,
    ProtocolError,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
    decode,
    encode,
)
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
MAX_OUTBOX = 100_000


class ColocatedNode:
    def __init__(
        self,
        engine: LLMEngine | EngineConfig | Mapping[str, Any],
        node_id: str,
        listen_address: str,
        router_address: str,
        heartbeat_interval: float = 0.5,
    ) -> None:
        if isinstance(engine, Mapping):
            engine = EngineConfig(**engine)
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
        self.node_id = node_id
        self.listen_address = listen_address
        self.router_address = router_address
        self.heartbeat_interval = heartbeat_interval
        self.active: set[str] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._stop = threading.Event()
        self._outbox: collections.deque[bytes] = collections.deque()

    def stop(self) -> None:
        """Asks `run()` to return after the current iteration (safe from signal handlers)."""
        self._stop.set()

    def run(self) -> None:
        context = zmq.Context()
        self._pull = context.socket(zmq.PULL)
        self._push = context.socket(zmq.PUSH)
        try:
            self._pull.bind(self.listen_address)
            self._push.connect(self.router_address)
            poller = zmq.Poller()
            poller.register(self._pull, zmq.POLLIN)
            logger.info(
                "node %s listening on %s, sending to %s",
                self.node_id,
                self.listen_address,
                self.router_address,
            )
            self._send_stats()
            next_heartbeat = time.monotonic() + self.heartbeat_interval
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                if poller.poll(0 if busy else IDLE_POLL_MS):
                    self._drain()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._flush()
                if time.monotonic() >= next_heartbeat:
                    self._send_stats()
                    next_heartbeat = time.monotonic() + self.heartbeat_interval
        finally:
            self._pull.close(linger=0)
            self._push.close(linger=0)
            context.term()
            logger.info("node %s stopped", self.node_id)

    # -- inbound ---------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode(data)
            except ProtocolError as error:
                logger.warning("dropped a malformed message (%d bytes): %s", len(data), error)
                continue
            if isinstance(message, Generate):
                self._admit(message)
            elif isinstance(message, Abort):
                self._abort(message.request_id)
            else:
                logger.warning("dropped an unexpected %s message", message.type)

    def _admit(self, message: Generate) -> None:
        request_id = message.request_id
        try:
            if request_id in self.active or request_id in self.engine.sequences:
                raise ValueError(f"request id {request_id!r} is already in use")
            params = SamplingParams(**message.sampling)
            self.engine.add_request(request_id, message.prompt_token_ids, params)
        except (ValueError, TypeError) as error:
            logger.info("rejected request %s: %s", request_id, error)
            self._send(RequestFailed(request_id, str(error), 400))
            return
        except Exception as error:  # a bad request must not kill the node
            logger.exception("failed to admit request %s", request_id)
            self._send(RequestFailed(request_id, f"internal error: {error}", 500))
            return
        self.active.add(request_id)
        self.prompt_tokens_total += len(message.prompt_token_ids)
        logger.info(
            "admitted request %s (%d prompt tokens, max_tokens %d)",
            request_id,
            len(message.prompt_token_ids),
            params.max_tokens,
        )

    def _abort(self, request_id: str) -> None:
        if request_id not in self.active:
            return
        self.active.discard(request_id)
        self.engine.abort_request(request_id)
        logger.info("aborted request %s", request_id)

    # -- stepping --------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # fail the requests, keep the node
            logger.exception("engine step failed; failing %d in-flight requests", len(self.active))
            self._fail_all("engine error while generating")
            return
        if not outputs:
            return
        self._send(TokenBatch(self.node_id, [self._update(o) for o in outputs]))

    def _update(self, output: StepOutput) -> TokenUpdate:
        self.generation_tokens_total += len(output.new_token_ids)
        logprobs = None
        if output.new_logprobs:
            logprobs = [
                [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top]] for lp in output.new_logprobs
            ]
        if output.finish_reason is not None:
            self.active.discard(output.request_id)
            logger.info("finished request %s (%s)", output.request_id, output.finish_reason)
        return TokenUpdate(
            output.request_id,
            list(output.new_token_ids),
            output.finish_reason,
            output.num_prompt_tokens,
            logprobs,
            output.num_cached_tokens,
            output.offset,
        )

    def _fail_all(self, message: str) -> None:
        for request_id in sorted(self.active):
            self._send(RequestFailed(request_id, message, 500))
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
        self.active.clear()

    # -- outbound --------------------------------------------------------------------------

    def _stats(self) -> NodeStats:
        engine = self.engine
        cache_stats = engine.block_manager.prefix_cache.stats
        return NodeStats(
            node_id=self.node_id,
            role="colocated",
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            num_waiting=len(engine.scheduler.waiting),
            num_running=len(engine.scheduler.running),
            num_free_blocks=engine.block_manager.num_free_blocks,
            num_total_blocks=engine.block_manager.num_blocks,
            num_preemptions=engine.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_cached_blocks=engine.block_manager.num_cached_blocks,
            prefix_cache_queries_total=cache_stats.queries,
            prefix_cache_hits_total=cache_stats.hits,
            prefix_cache_evicted_blocks_total=cache_stats.evicted_blocks,
        )

    def _send_stats(self) -> None:
        """Heartbeats are droppable: skipped while results wait, dropped if the pipe is full."""
        if self._outbox:
            return
        try:
            self._push.send(encode(self._stats()), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _send(self, message: Any) -> None:
        """Results are not droppable: queued behind anything still waiting, in order."""
        if len(self._outbox) >= MAX_OUTBOX:
            self._outbox.popleft()
            logger.error("outbox full (router unreachable?): dropped the oldest message")
        self._outbox.append(encode(message))
        self._flush()

    def _flush(self) -> None:
        while self._outbox:
            try:
                self._push.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()
