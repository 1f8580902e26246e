"""Turns engine token steps into text: incremental detokenization and stop strings.

One `RequestState` per request. `process(step_outputs)` updates each request's cumulative
`RequestOutput` and returns the requests whose stop string matched, which the caller must end in
the engine (`LLMEngine.finish_request(id, "stop")`) so their blocks are freed.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pdserve.engine.outputs import RequestOutput, StepOutput
from pdserve.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.wire.sampling_params import SamplingParams


@dataclass
class RequestState:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    text_delta: str = ""


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.requests[request_id] = RequestState(
            output=RequestOutput(
                request_id=request_id,
                prompt=prompt,
                prompt_token_ids=list(prompt_token_ids),
                logprobs=[] if params.logprobs is not None else None,
            ),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            stop_matcher=StopStringMatcher(params.stop or []),
        )

    def process(self, step_outputs: list[StepOutput]) -> list[str]:
        """Applies one step; returns ids of requests that a stop string just ended."""
        stopped = []
        for step in step_outputs:
            state = self.requests.get(step.request_id)
            if state is None or state.output.finished:
                continue
            output = state.output
            output.token_ids.extend(step.new_token_ids)
            output.num_cached_tokens = step.num_cached_tokens
            if output.logprobs is not None:
                output.logprobs.extend(step.new_logprobs)
            text = state.detokenizer.add(step.new_token_ids)
            if step.finish_reason is not None:
                text += state.detokenizer.flush()
            emitted, hit_stop = state.stop_matcher.feed(text)
            if hit_stop:
                output.finish_reason = "stop"
                stopped.append(step.request_id)
            elif step.finish_reason is not None:
                emitted += state.stop_matcher.flush()
                output.finish_reason = step.finish_reason
            output.text += emitted
            state.text_delta = emitted
        return stopped

    def pop_finished(self) -> list[RequestOutput]:
        finished = [s.output for s in self.requests.values() if s.output.finished]
        for output in finished:
            del self.requests[output.request_id]
        return finished
