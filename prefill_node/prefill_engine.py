"""Prefill-only driving of an `LLMEngine`: prompts run to their first token, and their KV
blocks leave for the decode node chunk by chunk.

Lifecycle of one request:
  add()        queued in the engine with the request's own sampling parameters but
               max_tokens 1, so it ends when its first token is sampled; `dst_block_ids` are
               the blocks the decode node reserved, one per prompt block.
  each step    the blocks the step fills (and, with the last chunk, the partial last block)
               leave as `BlockWrite`s to their targets, one per layer group (`layers_per_write`,
               engine/kv/layer_group_export.py): handed to `step(issue)` the moment the forward
               has computed the group, so the copy of early layers overlaps the compute of later
               ones and of the next chunk (without `issue`, returned in the step's `writes`);
               the engine holds a reference on every exported source block
               (`export_prompt_blocks`), so neither the request's end nor prefix-cache eviction
               can reuse it while the transfer may still read it.
  first token  returned by `step()` too; the request is then done in the engine (its prompt
               blocks stay in the prefix cache) but its exported blocks stay held until
  release()    the owner calls it when the transfer completed or failed.
  abort()      ends the request wherever it is; held blocks stay held until release().
With choices (n > 1), the prompt is computed once under the request's id and every choice's
first token is sampled from its last position (engine/forks.py): each `FirstToken` names its
choice and the prompt (`prompt_id`), whose blocks leave once for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv.layer_group_export import ExportSink, layer_group_ends
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sample.prompt_logprobs import PromptTokenLogprobs
from pdserve.engine.sample.sampler import TokenLogprobs
from pdserve.wire.sampling_params import SamplingParams


@dataclass
class FirstToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int
    prompt_logprobs: list[PromptTokenLogprobs] | None = None
    prompt_id: str = ""  # the request whose prompt it is (its own id, or its choices' prompt)


@dataclass
class BlockWrite:
    """Filled source blocks of a request and the decode node's blocks they go to, over layers
    `layer_start` up to `layer_end` (None: every layer of the cache, as `KVSender.write`)."""

    request_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    layer_start: int = 0
    layer_end: int | None = None


@dataclass
class PrefillStep:
    """`progress`: prompt tokens computed so far of the prompts the step advanced without
    finishing (engine/outputs.py EngineStep.prompt_progress)."""

    writes: list[BlockWrite] = field(default_factory=list)
    first_tokens: list[FirstToken] = field(default_factory=list)
    progress: dict[str, int] = field(default_factory=dict)


@dataclass
class _Outgoing:
    dst_block_ids: list[int]
    held_block_ids: list[int] = field(default_factory=list)  # exported: sent or being sent
    dst_of: dict[int, int] = field(default_factory=dict)  # held source block -> its target


class PrefillEngine:
    def __init__(self, engine: LLMEngine, layers_per_write: int | None = None) -> None:
        """`layers_per_write`: the layers of each write (None or the model's layer count: one
        write of every layer after the forward)."""
        self.engine = engine
        self.num_layers = engine.model_config.num_layers
        self.group_ends = layer_group_ends(self.num_layers, layers_per_write or self.num_layers)
        self.outgoing: dict[str, _Outgoing] = {}
        self.prompt_of: dict[str, str] = {}  # a choice's id -> its prompt's, until sampled

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        dst_block_ids: list[int],
        priority: int = 0,
        choices: list[tuple[str, SamplingParams]] | None = None,
        group: str | None = None,
    ) -> None:
        """Raises ValueError for a bad request, or when the decode node reserved a number of
        blocks that does not match the prompt."""
        needed = self.engine.block_manager.blocks_for_tokens(len(prompt_token_ids))
        if len(dst_block_ids) != needed:
            raise ValueError(
                f"request {request_id}: {len(dst_block_ids)} target blocks for a prompt of "
                f"{len(prompt_token_ids)} tokens, which needs {needed}"
            )
        self.engine.add_request(
            request_id,
            prompt_token_ids,
            _first_only(params),
            priority,
            export_prompt_blocks=True,
            choices=[(c, _first_only(p)) for c, p in choices] if choices else None,
            group=group,
        )
        self.outgoing[request_id] = _Outgoing(list(dst_block_ids))
        self.prompt_of.update((c, request_id) for c, _ in choices or [])

    def step(self, issue: Callable[[BlockWrite], None] | None = None) -> PrefillStep:
        """One engine step: its block writes, each handed to `issue` as soon as its layers are
        computed (without `issue`: in the result's `writes`), then the first tokens it sampled
        (to announce after the writes are issued)."""
        result = PrefillStep()
        issue = issue or result.writes.append

        def emit(request_id: str, src: list[int], layer_start: int, layer_end: int) -> None:
            outgoing = self.outgoing[request_id]
            if layer_start == 0:
                start = len(outgoing.held_block_ids)
                outgoing.held_block_ids.extend(src)
                dst = outgoing.dst_block_ids[start : start + len(src)]
                outgoing.dst_of.update(zip(src, dst))
            whole = layer_start == 0 and layer_end == self.num_layers
            issue(
                BlockWrite(
                    request_id, src, [outgoing.dst_of[b] for b in src], layer_start,
                    None if whole else layer_end,
                )
            )

        engine_step = self.engine.step(ExportSink(self.group_ends, emit))
        result.progress = engine_step.prompt_progress
        for output in engine_step.outputs:
            logprobs = output.new_logprobs[0] if output.new_logprobs else None
            result.first_tokens.append(
                FirstToken(
                    output.request_id,
                    output.new_token_ids[0],
                    logprobs,
                    output.num_cached_tokens,
                    output.prompt_logprobs,
                    self.prompt_of.pop(output.request_id, output.request_id),
                )
            )
        return result

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort(self, request_id: str) -> None:
        """Ends a request, or one choice of it (its prompt goes on for the others)."""
        self.engine.abort_request(request_id)
        self.prompt_of.pop(request_id, None)

    def blocks_sent(self, request_id: str) -> int:
        outgoing = self.outgoing.get(request_id)
        return len(outgoing.held_block_ids) if outgoing is not None else 0

    def release(self, request_id: str) -> None:
        """Drops the holds of a request whose transfer completed or failed (idempotent)."""
        outgoing = self.outgoing.pop(request_id, None)
        if outgoing is not None:
            self.engine.release_blocks(outgoing.held_block_ids)
        for choice_id in [c for c, prompt in self.prompt_of.items() if prompt == request_id]:
            del self.prompt_of[choice_id]


def _first_only(params: SamplingParams) -> SamplingParams:
    """A request's settings for its first token alone."""
    return dataclasses.replace(
        params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=None
    )
