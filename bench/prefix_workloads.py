"""Workloads for the prefix-cache benchmark, as token ids over the non-special vocabulary.

- RAG: one shared system prompt, a distinct document per request, a short question, a short
  answer; Poisson arrivals (open loop).
- Multi-turn chat: conversations that share a system prompt; each turn appends the model's
  previous answer and a new user message, and is sent when the previous turn ends (closed loop).
- Distinct: unrelated prompts all at once, so nothing can be reused (the cache's overhead).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.bench.engine_driver import Arrival, Record


@dataclass(frozen=True)
class RagShape:
    system_tokens: int = 2000
    document_tokens: int = 500
    question_tokens: int = 20
    answer_tokens: int = 16


@dataclass(frozen=True)
class ChatShape:
    system_tokens: int = 200
    user_tokens: int = 60
    answer_tokens: int = 48
    turns: int = 4


class TokenSource:
    def __init__(self, tokenizer, vocab_size: int, seed: int) -> None:
        special = tokenizer.added_token_ids
        self.vocab = [t for t in range(min(vocab_size, len(tokenizer))) if t not in special]
        self.rng = random.Random(seed)

    def tokens(self, count: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(count)]


def rag_request(source: TokenSource, system: list[int], shape: RagShape) -> Arrival:
    prompt = system + source.tokens(shape.document_tokens) + source.tokens(shape.question_tokens)
    return Arrival(0.0, prompt, shape.answer_tokens, "rag")


def rag_arrivals(
    source: TokenSource, system: list[int], shape: RagShape, count: int, rate: float
) -> list[Arrival]:
    arrivals, at = [], 0.0
    for _ in range(count):
        arrival = rag_request(source, system, shape)
        arrival.at = at
        arrivals.append(arrival)
        at += source.rng.expovariate(rate)
    return arrivals


class ChatConversations:
    """Closed-loop chat: `first_turns()` starts every conversation; `follow_up(record)` is the
    next turn of the conversation a finished turn belongs to, until `shape.turns` turns."""

    def __init__(
        self, source: TokenSource, shape: ChatShape, conversations: int, stagger_s: float
    ) -> None:
        self.shape = shape
        self.system = source.tokens(shape.system_tokens)
        self.user_messages = [
            [source.tokens(shape.user_tokens) for _ in range(shape.turns)]
            for _ in range(conversations)
        ]
        self.stagger_s = stagger_s

    def first_turns(self) -> list[Arrival]:
        return [
            Arrival(
                i * self.stagger_s,
                self.system + messages[0],
                self.shape.answer_tokens,
                f"{i}/1",
            )
            for i, messages in enumerate(self.user_messages)
        ]

    def follow_up(self, record: Record) -> Arrival | None:
        conversation, turn = (int(part) for part in record.tag.split("/"))
        if turn >= self.shape.turns:
            return None
        prompt = record.prompt + record.output + self.user_messages[conversation][turn]
        return Arrival(0.0, prompt, self.shape.answer_tokens, f"{conversation}/{turn + 1}")


def distinct_arrivals(
    source: TokenSource, count: int, prompt_tokens: tuple[int, int], answer_tokens: int
) -> list[Arrival]:
    return [
        Arrival(0.0, source.tokens(source.rng.randint(*prompt_tokens)), answer_tokens, "distinct")
        for _ in range(count)
    ]
