"""Structured output in one engine: grammars compiled off the step loop, one matcher per
sequence, and the grammar's mask on the logits before any row picks its token.

The grammar library is llguidance (guidance-ai, the `guidance` backend of vLLM and SGLang),
picked over xgrammar 0.2.9 by measurement on the default model's tokenizer (SmolLM2-135M,
49,152 tokens), one CPU thread, llguidance 1.9.1 vs xgrammar 0.2.9:

                                         llguidance     xgrammar
  tokenizer preparation (once per engine)    330 ms       128 ms
  compile a 4-property JSON schema          0.4 ms       9.4 ms
  compile a 25-property nested schema       4.3 ms        17 ms
  compile json_object                       0.3 ms       4.9 ms
  mask fill per token, median (p90)     7-14 (137) us    2-4 (9) us
  accept a token                             1.1 us       0.7 us
  mask fill, 64 rows                  0.48 ms (0.15 ms on 2 threads)  0.17 ms

Compiling is on a request's path to its first token and comes once per distinct spec; the
mask fill is paid per token, but its microseconds are far below a decode step of any model
(bench/results/structured_output.md). llguidance compiles 4 to 25 times faster, reports a bad
schema, regex or grammar as a message instead of an exception, supports Lark grammars (the
`grammar` spec) and is one self-contained wheel; xgrammar needs apache-tvm-ffi besides.

Lifecycle of a constrained request (LLMEngine drives it):
  admitted   `admit(seq)` (add_request, add_prefilled_request). With its spec compiled and
             cached, the sequence gets its matcher at once, caught up with its output tokens
             (the first token of a prompt prefilled on another node), and is scheduled like
             any other. Otherwise its spec is compiled on a small thread pool (once per
             distinct spec, however many requests ask) and the sequence is HELD: it is one of
             the engine's requests but in none of the scheduler's queues, so it blocks no one.
  held       every `step()` polls first: a compiled spec's sequences get their matchers and
             join the scheduler (the waiting queue, or the running one for a prompt computed
             elsewhere); a failed one's requests are ended ("error") and `step()` raises
             StepFailure naming them, each with its GrammarError. A held request has no
             deadline of its own (the node's and the router's apply); when nothing else can
             run, `step()` waits up to HELD_WAIT_S for a compile instead of spinning.
  sampled    the sampler calls `apply_grammar_masks`: each constrained row's allowed tokens
             are a bitmask its matcher fills (the rows in parallel), applied with one
             masked_fill; greedy rows too, unconstrained rows untouched, nothing at all when
             no row is constrained.
  advanced   `Sequence.append_token` feeds each sampled token to the matcher
             (`SequenceGrammar.advance`); when nothing can follow it, the request ends with
             "stop" then and there. A grammar that is complete but may go on allows the stop
             tokens next, so the model chooses.
The matcher depends only on the output tokens: a preempted sequence (recompute or swap) keeps
it as it is, and a step that fails and runs again never advanced it (only `append_token` does).
The compile pool's threads only build the tokenizer (once, under a lock) and compile; the cache,
the compiles in flight and the held sequences belong to the engine's thread.

llguidance is imported by the first constrained request, not with this module: an engine, and
every node, runs without it, and refuses a constrained request there naming the package.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.sample.strict_schema import strict_schema
from pdserve.wire.structured_output import GrammarError, spec_key

if TYPE_CHECKING:
    import llguidance

    from pdserve.engine.sequence import Sequence
    from pdserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# JSON in one line with json.dumps' separators; free whitespace lets small models pad forever.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256  # compiled specs kept, least recently used dropped first
NUM_COMPILE_THREADS = 2
HELD_WAIT_S = 0.01
MAX_ERROR_CHARS = 500
LLGUIDANCE_REQUIREMENT = "llguidance>=1.9.1,<2"


def load_llguidance() -> Any:
    """The llguidance module (with its torch helpers), imported on first use; ValueError naming
    the package when it is not installed."""
    try:
        import llguidance
        import llguidance.torch
    except ImportError as error:
        raise ValueError(
            f"structured_output needs the package {LLGUIDANCE_REQUIREMENT!r}, which does not "
            f"import here ({error}); install it to constrain outputs"
        ) from None
    return llguidance


def grammar_text(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a checked spec (wire/structured_output.py)."""
    ((kind, body),) = spec.items()
    Matcher = load_llguidance().LLMatcher
    if kind == "json_schema":  # closed to keys it does not name (engine/sample/strict_schema.py)
        return Matcher.grammar_from_json_schema(strict_schema(body), defaults=JSON_FORMAT)
    if kind == "json_object":
        return Matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_FORMAT)
    if kind == "regex":
        return Matcher.grammar_from_regex(body)
    if kind == "choice":  # Lark string literals are JSON strings
        return Matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in body)
        )
    return Matcher.grammar_from_lark(body)


class SequenceGrammar:
    """One sequence's matcher: it fills the sequence's row of the mask and follows its output."""

    def __init__(
        self, request_id: str, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor
    ) -> None:
        self.request_id = request_id
        self.matcher = matcher
        self.executor = executor

    @property
    def complete(self) -> bool:
        """The output is a whole sentence of the grammar and nothing may follow it."""
        return self.matcher.is_stopped()

    def advance(self, token_id: int) -> str | None:
        """Feeds a sampled token; returns the finish reason it implies: "stop" when nothing
        may follow, "error" if the grammar refuses the token (the mask allowed it, so only a
        bug can make that happen)."""
        if not self.matcher.consume_token(token_id):
            logger.error(
                "request %s: the grammar refused sampled token %d: %s",
                self.request_id, token_id, self.matcher.get_error()[:MAX_ERROR_CHARS],
            )
            return "error"
        return "stop" if self.matcher.is_stopped() else None


class StructuredOutput:
    """The grammars of one engine: compiled on a thread pool, cached, attached to sequences."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`tokenizer` None (a model folder without one) refuses every constrained request;
        `vocab_size` is the logits' width; `eos_token_ids` are the tokens a complete grammar
        allows next."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids) or None
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self._held: dict[str, tuple[Sequence, str]] = {}  # request id -> (sequence, spec key)
        self._ready: list[Sequence] = []  # attached while others failed: for the next poll
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._grammar_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()

    @property
    def num_held(self) -> int:
        return len(self._held) + len(self._ready)

    def admit(self, seq: Sequence) -> bool:
        """True if `seq` may be scheduled now (no spec, or its grammar attached); False if it
        is held until `poll` returns it. ValueError if this engine cannot constrain it, or its
        output tokens so far are not in its (cached) grammar."""
        spec = seq.params.structured_output
        if spec is None:
            return True
        if self.tokenizer is None:
            raise ValueError(
                "structured_output needs the model's tokenizer, and this model folder has none"
            )
        load_llguidance()
        key = spec_key(spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            self._attach(seq, compiled)
            return True
        if key not in self._compiling:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, "grammar-compile")
            self._compiling[key] = self._pool.submit(self._compile, spec)
        self._held[seq.request_id] = (seq, key)
        return False

    def poll(self) -> tuple[list[Sequence], dict[str, Exception]]:
        """Looks at the compiles that ended. Returns the sequences now constrained (no longer
        held: to schedule), or, if any failed, none of those (the next poll returns them) but
        the errors of the failed ones (GrammarError for a spec that does not compile), which
        stay held until the engine ends them."""
        finished: dict[str, llguidance.LLMatcher | BaseException] = {}
        for key, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[key]
                error = future.exception()
                finished[key] = future.result() if error is None else error
                if error is None:
                    self._remember(key, finished[key])
        ready, self._ready = self._ready, []
        failed: dict[str, Exception] = {}
        for request_id, (seq, key) in list(self._held.items()):
            outcome = finished.get(key)
            if outcome is None:
                continue
            if isinstance(outcome, BaseException):
                failed[request_id] = outcome  # type: ignore[assignment]
                continue
            try:
                self._attach(seq, outcome)
            except GrammarError as error:
                failed[request_id] = error
                continue
            del self._held[request_id]
            ready.append(seq)
        if failed:
            self._ready, ready = ready, []
        return ready, failed

    def wait(self, timeout_s: float = HELD_WAIT_S) -> None:
        """Blocks until a compile ends or `timeout_s` passed (for when only held sequences
        are left, so the engine's loop does not spin)."""
        if self._compiling and not self._ready:
            wait(list(self._compiling.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def discard(self, request_id: str) -> Sequence | None:
        """Forgets a held request (to be ended); None if it is not held."""
        held = self._held.pop(request_id, None)
        if held is not None:
            return held[0]
        seq = next((s for s in self._ready if s.request_id == request_id), None)
        if seq is not None:
            self._ready.remove(seq)
        return seq

    def _attach(self, seq: Sequence, compiled: llguidance.LLMatcher) -> None:
        matcher = compiled.deep_copy()
        output = seq.output_token_ids
        if output and not matcher.consume_tokens(output):
            raise GrammarError(
                f"structured_output: the output so far ({len(output)} tokens) is not in the "
                f"grammar: {matcher.get_error()[:MAX_ERROR_CHARS]}"
            )
        if self._executor is None:
            self._executor = load_llguidance().LLExecutor()
        seq.grammar = SequenceGrammar(seq.request_id, matcher, self._executor)

    def _remember(self, key: str, compiled: llguidance.LLMatcher) -> None:
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)

    def _compile(self, spec: dict[str, Any]) -> llguidance.LLMatcher:
        """Runs on the pool: the spec's grammar, compiled for this tokenizer."""
        ((kind, _),) = spec.items()
        try:
            text = grammar_text(spec)
        except ValueError as error:
            raise GrammarError(f"structured_output.{kind} does not compile: {error}") from None
        matcher = load_llguidance().LLMatcher(self._tokenizer_for_grammars(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"structured_output.{kind} does not compile: "
                f"{matcher.get_error()[:MAX_ERROR_CHARS]}"
            )
        return matcher

    def _tokenizer_for_grammars(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, built once (about 0.3 s for 49k tokens) by the
        first compile that needs it."""
        with self._tokenizer_lock:
            if self._grammar_tokenizer is None:
                backend = copy.copy(self.tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._grammar_tokenizer = load_llguidance().LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._grammar_tokenizer


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Sets to -inf, in place, the logits ([len(seqs), vocab]) of every token a constrained
    row's grammar does not allow next; the other rows are left bit for bit as they were."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return
    grammars = [seqs[row].grammar for row in rows]
    vocab = logits.shape[-1]
    bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
    load_llguidance().torch.fill_next_token_bitmask_par(
        grammars[0].executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask
    )
    device = logits.device
    bits = torch.tensor(
        [1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device
    )
    refused = (bitmask.to(device)[:, :, None] & bits).eq(0).view(len(rows), -1)[:, :vocab]
    if len(rows) == len(seqs):
        logits.masked_fill_(refused, float("-inf"))
    else:
        index = torch.tensor(rows, device=device)
        masked = logits.index_select(0, index).masked_fill_(refused, float("-inf"))
        logits.index_copy_(0, index, masked)
