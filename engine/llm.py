"""Offline entry point: `LLM(model, **config).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import RequestOutput
from pdserve.wire.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generates for a batch of prompts with continuous batching, returning outputs in order.

    `model` is a model folder, or None for the default model (downloaded on first use); the
    keywords are `EngineConfig` fields (max_num_batched_tokens, max_num_seqs, max_model_len,
    block_size, kv_cache_memory, dtype, tensor_parallel_size, ...). With
    `tensor_parallel_size` > 1 it starts a worker process per further rank; `close()` stops
    them, as does collecting the LLM or exiting.
    """

    def __init__(self, model: str | None = None, **config: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()

    def close(self) -> None:
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        params = params if params is not None else SamplingParams()
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        encoded = [self._encode(p) for p in prompts]
        for ids, p in zip(encoded, param_list):
            self.engine.validate_prompt(ids, p)
        return self._run(
            [(p if isinstance(p, str) else None, ids) for p, ids in zip(prompts, encoded)],
            param_list,
        )

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields one prompt's text as it is generated, piece by piece."""
        params = params or SamplingParams()
        ids = self._encode(prompt)
        self.engine.validate_prompt(ids, params)
        processor = OutputProcessor(self.tokenizer)
        request_id = self._submit(processor, None, ids, params)
        state = processor.requests[request_id]
        try:
            while not state.output.finished:
                self._step(processor)
                if state.text_delta:
                    yield state.text_delta
                    state.text_delta = ""
        finally:
            self.engine.abort_request(request_id)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a token-id prompt must be a list of integers")
        return list(prompt)

    def _submit(
        self, processor: OutputProcessor, text: str | None, ids: list[int], params: SamplingParams
    ) -> str:
        request_id = str(next(self._request_counter))
        self.engine.add_request(request_id, ids, params)
        processor.add_request(request_id, text, ids, params)
        return request_id

    def _step(self, processor: OutputProcessor) -> None:
        """One engine step through the processor; requests a stop string ended are finished."""
        for request_id in processor.process(self.engine.step().outputs):
            self.engine.finish_request(request_id, "stop")

    def _run(
        self, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        request_ids = []
        try:
            for (text, ids), p in zip(prompts, params):
                request_ids.append(self._submit(processor, text, ids, p))
            results: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                self._step(processor)
                results.update((o.request_id, o) for o in processor.pop_finished())
        finally:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
        return [results[r] for r in request_ids]
