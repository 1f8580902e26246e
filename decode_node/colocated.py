"""The colocated node: one LLMEngine, prefill and decode together (node loop: node_runtime.py).

Inbound: Generate -> SamplingParams and engine.add_request (ValueError/TypeError, duplicate ids
included, -> RequestFailed 400); Abort -> engine.abort_request (unknown ids ignored).
Each iteration: one engine.step(); if it produced outputs, ONE TokenBatch with a TokenUpdate
per request. A request that makes the step fail on its own (engine.llm_engine.StepFailure, which
names it; the engine already ended it) gets RequestFailed 500, and the others of that step run
again on the next one. Any other exception while stepping is logged, every in-flight request
gets RequestFailed 500 and is aborted, and the loop goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, StepFailure
from engine.node_runtime import NodeRuntime
from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from wire.cluster_auth import ClusterAuth
from wire.messages import Abort, Generate, RequestFailed, TokenBatch, TokenUpdate

logger = logging.getLogger(__name__)


def build_engine(engine: LLMEngine | EngineConfig | Mapping[str, Any], **kwargs: Any) -> LLMEngine:
    if isinstance(engine, Mapping):
        engine = EngineConfig(**engine)
    return engine if isinstance(engine, LLMEngine) else LLMEngine(engine, **kwargs)


class ColocatedNode(NodeRuntime):
    role = "colocated"

    def __init__(
        self,
        engine: LLMEngine | EngineConfig | Mapping[str, Any],
        node_id: str,
        listen_address: str,
        router_address: str,
        heartbeat_interval: float = 0.5,
        advertise_address: str | None = None,
        cluster_auth: ClusterAuth | None = None,
    ) -> None:
        super().__init__(
            build_engine(engine),
            node_id,
            listen_address,
            router_address,
            heartbeat_interval,
            advertise_address,
            cluster_auth=cluster_auth,
        )
        self.active: set[str] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- inbound ---------------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, Generate):
            self._admit(message)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        else:
            super().handle(message)

    def _admit(self, message: Generate) -> None:
        request_id = message.request_id
        try:
            if request_id in self.active or request_id in self.engine.sequences:
                raise ValueError(f"request id {request_id!r} is already in use")
            params = SamplingParams(**message.sampling)
            self.engine.add_request(
                request_id, message.prompt_token_ids, params, message.priority
            )
        except (ValueError, TypeError) as error:
            logger.info("rejected request %s: %s", request_id, error)
            self.send(RequestFailed(request_id, str(error), 400))
            return
        except Exception as error:  # a bad request must not kill the node
            logger.exception("failed to admit request %s", request_id)
            self.send(RequestFailed(request_id, f"internal error: {error}", 500))
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

    def work(self) -> None:
        if self.engine.has_unfinished_requests():
            self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailure as failure:
            for request_id, error in failure.errors.items():
                if request_id in self.active:
                    self.active.discard(request_id)
                    message = f"internal error while generating ({type(error).__name__})"
                    self.send(RequestFailed(request_id, message, 500))
            return
        except Exception:  # fail the requests, keep the node
            logger.exception("engine step failed; failing %d in-flight requests", len(self.active))
            self._fail_all("engine error while generating")
            return
        if not outputs:
            return
        self.send(TokenBatch(self.node_id, [self._update(o) for o in outputs]))

    def _update(self, output: StepOutput) -> TokenUpdate:
        self.generation_tokens_total += len(output.new_token_ids)
        logprobs = [lp.to_wire() for lp in output.new_logprobs] or None
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
            self.send(RequestFailed(request_id, message, 500))
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
        self.active.clear()

    # -- outbound --------------------------------------------------------------------------

    def stats_fields(self) -> dict[str, Any]:
        return {
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }
