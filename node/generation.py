"""The requests a node generates in its own engine (colocated and decode nodes), and the token
batches they stream to the router.

Lifecycle of a request here:
  admitted   a Generate whose prompt this engine computes (`admit`: a bad request is refused
             alone, RequestFailed 400, or 500 for anything unexpected), or
  joined     a prompt a prefill node computed, whose KV already sits in `block_ids` (`join`,
             decode nodes): it starts decoding after its first token, so its tokens stream
             from offset 1;
A Generate with `choices` (n > 1) is one prompt computed once and forked into its choices
(engine/forks.py); from then on each choice is a request of its own here, by its id (its
tokens, its abort, its failure); joined, every choice takes the transferred blocks.

  active     every engine step's outputs become ONE TokenBatch (a TokenUpdate per request;
             one carrying a prompt's logprobs goes in a TokenBatch of its own), after one
             PromptProgress for the prompts the step advanced without finishing;
  ended      by its finish reason, by `abort` (the router's Abort), or by a failed step: a
             request that fails the step on its own (engine.llm_engine.StepFailure names it;
             the engine already ended it) gets RequestFailed 500, or 400 if its structured
             output spec did not compile (GrammarError), and the others run again on the
             next step; a failed tensor-parallel rank (RankFailure) stops the node, whose
             requests the router then fails or retries as for any node that died; any other
             exception fails every active request (500) and aborts it, and the node goes on.
`step()` and the others return the messages for the router; the node sends them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.engine.distributed.group import RankFailure
from pdserve.engine.forks import join_prefilled_choices
from pdserve.engine.llm_engine import LLMEngine, StepFailure
from pdserve.engine.outputs import StepOutput
from pdserve.wire.messages import (
    Generate,
    PrefillDone,
    PrefillRequest,
    PromptProgress,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
)
from pdserve.wire.node_stats import TokenTotals
from pdserve.wire.sampling_params import SamplingParams
from pdserve.wire.structured_output import GrammarError

logger = logging.getLogger(__name__)


def check_request_id(request_id: str, in_use: bool) -> None:
    """The check every role makes before taking a request (its sampling settings were checked
    as its message was decoded): its id is not in use here. ValueError (the request's 400)
    otherwise."""
    if in_use:
        raise ValueError(f"request id {request_id!r} is already in use")


def choice_params(
    message: Generate | PrefillRequest, in_use: Callable[[str], bool]
) -> list[tuple[str, SamplingParams]]:
    """Each choice's id and sampling settings (none for a one-choice request); ValueError (the
    request's 400) for an id in use."""
    for choice in message.choices:
        check_request_id(choice.request_id, in_use(choice.request_id))
    return [(c.request_id, c.sampling) for c in message.choices]


def step_failure(request_id: str, error: Exception, doing: str) -> RequestFailed:
    """The router's message for a request that failed an engine step alone: 400 with the
    compiler's message when its structured output spec did not compile, else 500."""
    if isinstance(error, GrammarError):
        return RequestFailed(request_id, str(error), 400)
    return RequestFailed(
        request_id, f"internal error while {doing} ({type(error).__name__})", 500
    )


class Generation:
    def __init__(self, engine: LLMEngine, node_id: str) -> None:
        self.engine = engine
        self.node_id = node_id
        self.active: set[str] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def in_use(self, request_id: str) -> bool:
        engine = self.engine
        return (
            request_id in self.active or request_id in engine.sequences or request_id in engine.forks
        )

    def admit(self, message: Generate) -> RequestFailed | None:
        """Queues a request whose prompt this engine computes; its refusal, if refused."""
        request_id = message.request_id
        try:
            check_request_id(request_id, self.in_use(request_id))
            params = message.sampling
            choices = choice_params(message, self.in_use)
            self.engine.add_request(
                request_id, message.prompt_token_ids, params, message.priority,
                choices=choices or None, group=message.group,
            )
        except (ValueError, TypeError) as error:
            logger.info("rejected request %s: %s", request_id, error)
            return RequestFailed(request_id, str(error), 400)
        except Exception as error:  # a bad request must not kill the node
            logger.exception("failed to admit request %s", request_id)
            return RequestFailed(request_id, f"internal error: {error}", 500)
        self.active.update([c for c, _ in choices] or [request_id])
        self.prompt_tokens_total += len(message.prompt_token_ids)
        logger.info(
            "admitted request %s (%d prompt tokens, max_tokens %d, %d choices)",
            request_id,
            len(message.prompt_token_ids),
            params.max_tokens,
            len(choices) or 1,
        )
        return None

    def join(
        self,
        message: Generate,
        params: SamplingParams,
        block_ids: list[int],
        first: PrefillDone,
        arrival_time: float,
        choices: list[tuple[str, SamplingParams]] | None = None,
    ) -> TokenBatch | None:
        """Starts decoding a request prefilled elsewhere, from its first token; the batch that
        ends it when the first token already did. With `choices` (those still wanted), each
        one the prefill node sampled joins with its own first token, sharing `block_ids`.
        ValueError if the engine cannot take it (the caller still owns `block_ids` then)."""
        if choices is not None:
            return self._join_choices(message, block_ids, first, arrival_time, choices)
        request_id = message.request_id
        reason = self.engine.add_prefilled_request(
            request_id,
            message.prompt_token_ids,
            params,
            block_ids,
            first.token_id,
            first.num_cached_tokens,
            message.priority,
            arrival_time=arrival_time,
        )
        self.generation_tokens_total += 1
        if reason is None:
            self.active.add(request_id)
            return None
        update = TokenUpdate(
            request_id=request_id,
            token_ids=[],
            finish_reason=reason,
            num_prompt_tokens=len(message.prompt_token_ids),
            num_cached_tokens=first.num_cached_tokens,
            offset=1,
        )
        return TokenBatch(self.node_id, [update])

    def _join_choices(
        self,
        message: Generate,
        block_ids: list[int],
        first: PrefillDone,
        arrival_time: float,
        choices: list[tuple[str, SamplingParams]],
    ) -> TokenBatch | None:
        sampled = {c.request_id: c.token_id for c in first.choices}
        joining = [(c, p, sampled[c]) for c, p in choices if c in sampled]
        if not joining:  # every choice was aborted on the prefill node
            self.engine.release_blocks(block_ids)
            return None
        reasons = join_prefilled_choices(
            self.engine, message.request_id, message.prompt_token_ids, joining, block_ids,
            first.num_cached_tokens, message.priority, arrival_time,
        )
        self.generation_tokens_total += len(joining)
        updates = []
        for choice_id, reason in reasons.items():
            if reason is None:
                self.active.add(choice_id)
                continue
            updates.append(
                TokenUpdate(
                    request_id=choice_id,
                    token_ids=[],
                    finish_reason=reason,
                    num_prompt_tokens=len(message.prompt_token_ids),
                    num_cached_tokens=first.num_cached_tokens,
                    offset=1,
                )
            )
        return TokenBatch(self.node_id, updates) if updates else None

    def abort(self, request_id: str) -> bool:
        """Ends an active request; False if it is not one."""
        if request_id not in self.active:
            return False
        self.active.discard(request_id)
        self.engine.abort_request(request_id)
        logger.info("aborted request %s", request_id)
        return True

    def step(self) -> list[TokenBatch | PromptProgress | RequestFailed]:
        """One engine step, if there is work; the messages it produced for the router."""
        if not self.engine.has_unfinished_requests():
            return []
        try:
            engine_step = self.engine.step()
        except StepFailure as failure:
            failed = []
            for request_id, error in failure.errors.items():
                if request_id not in self.active:
                    continue
                self.active.discard(request_id)
                failed.append(step_failure(request_id, error, "generating"))
            return failed
        except RankFailure:  # a tensor-parallel rank is gone: the node stops (docstring)
            raise
        except Exception:  # fail the requests, keep the node
            logger.exception("engine step failed; failing %d in-flight requests", len(self.active))
            return self._fail_all("engine error while generating")
        progress = engine_step.prompt_progress
        messages = [PromptProgress(self.node_id, progress)] if progress else []
        updates = [self._update(output) for output in engine_step.outputs]
        plain = [u for u in updates if u.prompt_logprobs is None]
        batches = [*messages, TokenBatch(self.node_id, plain)] if plain else messages
        # a prompt's scores travel alone: one prompt bounds a message (wire/messages.py)
        batches += [TokenBatch(self.node_id, [u]) for u in updates if u.prompt_logprobs is not None]
        return batches

    def _update(self, output: StepOutput) -> TokenUpdate:
        self.generation_tokens_total += len(output.new_token_ids)
        if output.finish_reason is not None:
            self.active.discard(output.request_id)
            logger.info("finished request %s (%s)", output.request_id, output.finish_reason)
        return TokenUpdate(
            request_id=output.request_id,
            token_ids=list(output.new_token_ids),
            finish_reason=output.finish_reason,
            num_prompt_tokens=output.num_prompt_tokens,
            logprobs=[lp.to_wire() for lp in output.new_logprobs] or None,
            num_cached_tokens=output.num_cached_tokens,
            offset=output.offset,
            prompt_logprobs=(
                [entry.to_wire() for entry in output.prompt_logprobs]
                if output.prompt_logprobs is not None
                else None
            ),
        )

    def _fail_all(self, message: str) -> list[RequestFailed]:
        failed = []
        for request_id in sorted(self.active):
            failed.append(RequestFailed(request_id, message, 500))
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
        self.active.clear()
        return failed

    def token_totals(self) -> TokenTotals:
        return TokenTotals(self.prompt_tokens_total, self.generation_tokens_total)
