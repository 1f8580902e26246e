"""Builds the HTTP answer of a running `Generation`: one JSON body, or an SSE stream of
chunks ending in `data: [DONE]`, for the completions and the chat completions API. With `echo`
a choice's first event (its first chunk, when streaming) carries its prompt's text and, with
`logprobs`, the prompt's logprobs before the output's (router/api/echo.py). With
`--reasoning-parser` a chat choice's thinking is told from its answer first
(text/reasoning_split.py): `message.reasoning_content`, or `delta.reasoning_content`, and only
the answer is content (a request with `include_reasoning: false`, vLLM's field, gets no
reasoning). A chat with tools has the answer read for tool calls (router/api/tool_output.py):
`message.tool_calls`, or `delta.tool_calls` entries, instead of content."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.router.api import schemas
from pdserve.router.api.logprobs import LogprobFormatter, merge_completion
from pdserve.router.api.sse import DONE, sse
from pdserve.router.api.tool_output import ToolCallOutput
from pdserve.router.errors import APIError
from pdserve.router.generation import ChoiceEvent, Generation
from pdserve.text.reasoning_split import ReasoningStyle, ThinkingSplitter, split_whole

logger = logging.getLogger(__name__)


class Responder:
    def __init__(
        self,
        chat: bool,
        generation: Generation,
        model: str,
        formatter: LogprobFormatter,
        include_usage: bool = False,
        reasoning: ReasoningStyle | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self.chat = chat
        self.generation = generation
        self.model = model
        self.formatter = formatter
        self.include_usage = include_usage
        self.created = int(time.time())
        self.id = generation.request_id
        n = generation.plan.n
        self._text = [""] * n
        self._logprobs: list[Any] = [None] * n
        self._finish: list[str | None] = [None] * n
        self._echoed = [False] * n
        self._prompt_logprobs: list[Any] = [None] * n  # vLLM's shape, when asked
        tools = generation.plan.tools
        self._tool_calls = ToolCallOutput(tools, n) if chat and tools is not None else None
        self.reasoning = reasoning if chat else None
        self.include_reasoning = include_reasoning
        self._thinking = [ThinkingSplitter(reasoning) for _ in range(n)] if self.reasoning else []

    def _usage(self) -> schemas.Usage:
        generation = self.generation
        return schemas.usage(
            generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens
        )

    def _done(self) -> None:
        generation = self.generation
        generation.metrics.request_finished(
            generation.arrived_at,
            generation.submitted_at or generation.arrived_at,
            generation.prompt_tokens,
            generation.completion_tokens,
            time.monotonic(),
        )

    def _format_logprobs(self, event: ChoiceEvent) -> dict[str, Any] | None:
        if event.logprobs is None or self.generation.plan.logprobs is None:
            return None
        if self.chat:
            return self.formatter.chat(event.logprobs)
        return self.formatter.completion(event.logprobs, len(self._text[event.index]))

    def _echo(self, event: ChoiceEvent) -> tuple[str, dict[str, Any] | None]:
        """The prompt text and logprobs a choice's first event starts with (with `echo`),
        recorded; the prompt's scores in vLLM's shape too, when asked."""
        i = event.index
        plan = self.generation.plan
        prompt = plan.prompt_of(i)
        if event.prompt_logprobs is not None and plan.prompt_logprobs is not None:
            self._prompt_logprobs[i] = self.formatter.prompt_logprobs(
                prompt, event.prompt_logprobs
            )
        if plan.echo_prompts is None or self._echoed[i]:
            return "", None
        self._echoed[i] = True
        text = plan.echo_prompts[i // plan.choices_per_prompt]
        self._text[i] += text
        logprobs = None
        if plan.logprobs is not None:
            logprobs = self.formatter.echoed_prompt(prompt, event.prompt_logprobs, plan.logprobs)
            self._logprobs[i] = merge_completion(self._logprobs[i], logprobs)
        return text, logprobs

    def _absorb(self, event: ChoiceEvent) -> tuple[str, dict[str, Any] | None]:
        """Records the event; returns its text and formatted logprobs, each with the echoed
        prompt before them on a choice's first event."""
        echoed_text, echoed_logprobs = self._echo(event)
        logprobs = self._format_logprobs(event)
        i = event.index
        if logprobs is not None:
            if self.chat:
                prev = self._logprobs[i] or {"content": []}
                self._logprobs[i] = {"content": prev["content"] + logprobs["content"]}
            else:
                self._logprobs[i] = merge_completion(self._logprobs[i], logprobs)
        self._text[i] += event.text
        if event.finish_reason is not None:
            self._finish[i] = event.finish_reason
        if echoed_logprobs is not None:
            logprobs = merge_completion(echoed_logprobs, logprobs) if logprobs else echoed_logprobs
        return echoed_text + event.text, logprobs

    # -- one JSON body -----------------------------------------------------------------------

    async def collect(self, events: AsyncIterator[list[ChoiceEvent]]) -> dict[str, Any]:
        async for batch in events:
            for event in batch:
                self._absorb(event)
        self._done()
        make_choice = schemas.chat_choice if self.chat else schemas.completion_choice
        choices = [
            make_choice(i, self._text[i], self._finish[i], self._logprobs[i])
            for i in range(self.generation.plan.n)
        ]
        for choice in choices:
            self._split_message(choice)
        object_name = "chat.completion" if self.chat else "text_completion"
        body = schemas.response_body(
            object_name, self.id, self.created, self.model, choices, self._usage()
        )
        if self.generation.plan.prompt_logprobs is not None:  # where vLLM puts them
            if self.chat:
                body["prompt_logprobs"] = self._prompt_logprobs[0]
            else:
                for choice, prompt_logprobs in zip(choices, self._prompt_logprobs):
                    choice["prompt_logprobs"] = prompt_logprobs
        return body

    def _split_message(self, choice: dict[str, Any]) -> None:
        """A whole chat choice's text: reasoning apart, then tool calls read from the rest."""
        message = choice.get("message")
        if message is None:
            return
        reasoning = None
        if self.reasoning is not None:
            split = split_whole(self.reasoning, message["content"])
            message["content"] = split.content
            reasoning = split.reasoning if self.include_reasoning else None
        if self._tool_calls is not None:
            self._tool_calls.message(choice)
        if self.reasoning is not None:
            if message["content"] == "" and reasoning:
                message["content"] = None
            message["reasoning_content"] = reasoning or None

    # -- SSE ---------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(
            schemas.chunk(
                self.id,
                obj,
                self.created,
                self.model,
                choices,
                use,
                with_usage_field=self.include_usage,
            )
        )

    def _event_chunk(self, event: ChoiceEvent) -> dict[str, Any] | None:
        """The event's chunk choice; None when a tool call reader holds all of it back."""
        text, logprobs = self._absorb(event)
        if not self.chat:
            return schemas.completion_choice(event.index, text, event.finish_reason, logprobs)
        finish_reason = event.finish_reason
        text, reasoning = event.text, ""
        if self._thinking:
            split = self._thinking[event.index].feed(text, finished=finish_reason is not None)
            text, reasoning = split.content, split.reasoning if self.include_reasoning else ""
            if not (text or reasoning or finish_reason or logprobs):
                return None  # the splitter holds what may be a tag
        if self._tool_calls is not None:
            delta, finish_reason = self._tool_calls.delta(event.index, text, finish_reason)
            if delta is None and not reasoning and logprobs is None:
                return None
        else:
            delta = {"content": text} if text or (finish_reason is None and not reasoning) else {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **(delta or {})}
        return schemas.chat_chunk_choice(event.index, delta or {}, finish_reason, logprobs)

    async def stream(
        self, events: AsyncIterator[list[ChoiceEvent]], first: list[ChoiceEvent]
    ) -> AsyncIterator[bytes]:
        """The SSE body; `first` is the batch already taken from `events` (so that errors
        before the first token are answered with a proper status). An error after that,
        expected or not, is the stream's last event before `data: [DONE]`: the response
        still ends properly, so the client's connection stays usable."""
        try:
            if self.chat:
                for i in range(self.generation.plan.n):
                    delta = {"role": "assistant", "content": ""}
                    yield self._chunk([schemas.chat_chunk_choice(i, delta, None)])
            batch: list[ChoiceEvent] | None = first
            while batch is not None:
                for event in batch:
                    choice = self._event_chunk(event)
                    if choice is not None:
                        yield self._chunk([choice])
                batch = await anext(events, None)
            self._done()
            if self.include_usage:
                yield self._chunk([], self._usage())
        except APIError as error:
            self.generation.metrics.error(error.type)
            yield sse(error.body())
        except Exception as error:
            logger.exception("request %s failed while streaming: %s", self.id, type(error).__name__)
            self.generation.metrics.error("server_error")
            yield sse(APIError(500, "internal server error").body())
        finally:
            self.generation.close()
            await events.aclose()
        yield DONE
