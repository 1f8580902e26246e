"""Prefill-only driving of an `LLMEngine`: prompts run to their first token, and their KV
blocks leave for the decode node chunk by chunk.

Lifecycle of one request:
  add()        queued in the engine with the request's own sampling parameters but
               max_tokens 1, so it ends when its first token is sampled; `dst_block_ids` are
               the blocks the decode node reserved, one per prompt block.
  each step    after a chunk's forward, the blocks that chunk completed (and, with the last
               chunk, the partial last block) are handed to `write(request_id, src, dst)` at
               once, so the copy overlaps the next chunk; the engine holds a reference on every
               written source block, so neither the request's end nor prefix-cache eviction
               can reuse it while the transfer may still read it.
  first token  returned by `step()`; the request is then done in the engine (its prompt blocks
               stay in the prefix cache) but its written blocks stay held until
  release()    the owner calls it when the transfer completed or failed.
  abort()      ends the request wherever it is; held blocks stay held until release().
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BlockWriter = Callable[[str, list[int], list[int]], None]


@dataclass
class FirstToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int


@dataclass
class _Outgoing:
    dst_block_ids: list[int]
    num_blocks_sent: int = 0
    held_block_ids: list[int] = field(default_factory=list)


class PrefillEngine:
    def __init__(self, engine: LLMEngine, write: BlockWriter) -> None:
        self.engine = engine
        self.write = write
        self.outgoing: dict[str, _Outgoing] = {}
        engine.on_chunk_computed = self._send_completed_blocks

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        dst_block_ids: list[int],
        priority: int = 0,
    ) -> None:
        """Raises ValueError for a bad request, or when the decode node reserved a number of
        blocks that does not match the prompt."""
        needed = self.engine.block_manager.blocks_for_tokens(len(prompt_token_ids))
        if len(dst_block_ids) != needed:
            raise ValueError(
                f"request {request_id}: {len(dst_block_ids)} target blocks for a prompt of "
                f"{len(prompt_token_ids)} tokens, which needs {needed}"
            )
        first_only = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None
        )
        self.engine.add_request(request_id, prompt_token_ids, first_only, priority)
        self.outgoing[request_id] = _Outgoing(list(dst_block_ids))

    def step(self) -> list[FirstToken]:
        firsts = []
        for output in self.engine.step():
            logprobs = output.new_logprobs[0] if output.new_logprobs else None
            firsts.append(
                FirstToken(
                    output.request_id,
                    output.new_token_ids[0],
                    logprobs,
                    output.num_cached_tokens,
                )
            )
        return firsts

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def blocks_sent(self, request_id: str) -> int:
        outgoing = self.outgoing.get(request_id)
        return outgoing.num_blocks_sent if outgoing is not None else 0

    def release(self, request_id: str) -> None:
        """Drops the holds of a request whose transfer completed or failed (idempotent)."""
        outgoing = self.outgoing.pop(request_id, None)
        if outgoing is not None:
            self.engine.release_blocks(outgoing.held_block_ids)

    def _send_completed_blocks(self, seq: Sequence) -> None:
        outgoing = self.outgoing.get(seq.request_id)
        if outgoing is None:
            return
        block_size = self.engine.block_manager.block_size
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            ready = len(outgoing.dst_block_ids)
        else:
            ready = seq.num_computed_tokens // block_size
        start = outgoing.num_blocks_sent
        if ready <= start:
            return
        src = seq.block_table[start:ready]
        self.engine.hold_blocks(src)
        outgoing.held_block_ids.extend(src)
        outgoing.num_blocks_sent = ready
        self.write(seq.request_id, src, outgoing.dst_block_ids[start:ready])
