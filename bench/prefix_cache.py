"""Prefix cache off vs on, in one run, on the same engine settings and the same requests.

    python -m pdserve.bench.prefix_cache [--quick]

1. RAG: a 2,000-token system prompt shared by every request, a distinct 500-token document and
   a 20-token question each, 16-token answers. Poisson arrivals at `--load` times the cache-off
   prefill capacity, measured first in the same run (three lone requests' TTFT). Both engines
   first serve one warm-up request of the same shape (for the cache-on engine that caches the
   system prompt, as in steady-state serving).
2. Multi-turn chat: conversations sharing a 200-token system prompt, each turn 60 new user
   tokens and a 48-token answer, the next turn sent when the previous one ends.
3. Overhead: distinct prompts, nothing to reuse; wall time off/on alternated, plus the time the
   engine spends inside prefix-cache operations, measured directly.
Writes bench/results/prefix_cache.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pdserve.bench.engine_driver import Record, drive, ideal_cached_tokens
from pdserve.bench.machine import machine_info
from pdserve.bench.prefix_report import build_report
from pdserve.bench.prefix_workloads import (
    ChatConversations,
    ChatShape,
    RagShape,
    TokenSource,
    distinct_arrivals,
    rag_arrivals,
    rag_request,
)

RESULTS = Path(__file__).parent / "results" / "prefix_cache.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.prefix_cache", description=__doc__
    )
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--rag-requests", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.8, help="of cache-off capacity")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--distinct-requests", type=int, default=32)
    parser.add_argument("--overhead-repeats", type=int, default=2)
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rag_requests, args.conversations, args.distinct_requests = 4, 2, 8
        args.overhead_repeats = 1
    return args


class TimedEngine:
    """Wraps one engine's step and its prefix-cache entry points with wall-clock totals."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.step_s = 0.0
        self.cache_s = 0.0
        manager = engine.block_manager
        manager.match_prefix = self._timed(manager.match_prefix, "cache_s")
        manager.cache_computed_blocks = self._timed(manager.cache_computed_blocks, "cache_s")
        manager.prefix_cache.evict = self._timed(manager.prefix_cache.evict, "cache_s")
        engine.step = self._timed(engine.step, "step_s")

    def _timed(self, function, total: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)

        return timed

    def reset(self) -> None:
        self.step_s = self.cache_s = 0.0


def build_engines(args: argparse.Namespace) -> dict[bool, TimedEngine]:
    from pdserve.engine import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engines = {}
    for enabled in (False, True):
        config = EngineConfig(
            model=args.model,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=enabled,
        )
        engines[enabled] = TimedEngine(LLMEngine(config))
    return engines


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def summarize(records: list[Record], ideal: list[int]) -> dict[str, float]:
    ttfts = sorted(r.ttft for r in records)
    return {
        "requests": len(records),
        "ttft_mean": statistics.fmean(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "prompt_tokens": sum(len(r.prompt) for r in records),
        "computed": sum(len(r.prompt) - r.num_cached_tokens for r in records),
        "hits": sum(r.num_cached_tokens for r in records),
        "ideal": sum(ideal),
        "wall": max(r.finished for r in records),
    }


def run_rag(engines, source: TokenSource, args) -> tuple[dict, dict, float]:
    """Warm-up, then three lone requests each way (median TTFT without queueing; the cache-off
    one sets the arrival rate), then the same Poisson arrivals each way."""
    shape = RagShape()
    system = source.tokens(shape.system_tokens)
    warmups = {
        on: drive(e.engine, [rag_request(source, system, shape)]) for on, e in engines.items()
    }
    lone = {
        on: statistics.median(
            drive(e.engine, [rag_request(source, system, shape)])[0].ttft for _ in range(3)
        )
        for on, e in engines.items()
    }
    rate = args.load / lone[False]
    say(f"RAG: lone TTFT off {lone[False]:.2f} s, on {lone[True]:.2f} s; {rate:.3f}/s")
    arrivals = rag_arrivals(source, system, shape, args.rag_requests, rate)
    results = {}
    for on, engine in engines.items():
        records = drive(engine.engine, arrivals)
        ideal = ideal_cached_tokens(records, engine.engine.config.block_size, warmups[on])
        results[on] = summarize(records, ideal)
        say(f"RAG cache {'on' if on else 'off'}: TTFT mean {results[on]['ttft_mean']:.2f} s")
    results[False]["lone_ttft"] = lone[False]
    results[True]["lone_ttft"] = lone[True]
    return results[False], results[True], rate


def run_chat(engines, source: TokenSource, args) -> tuple[dict, dict]:
    chat = ChatConversations(source, ChatShape(), args.conversations, stagger_s=0.25)
    results = {}
    for on, engine in engines.items():
        records = drive(engine.engine, chat.first_turns(), chat.follow_up)
        ideal = ideal_cached_tokens(records, engine.engine.config.block_size)
        results[on] = summarize(records, ideal)
        say(f"chat cache {'on' if on else 'off'}: TTFT mean {results[on]['ttft_mean']:.3f} s")
    return results[False], results[True]


def run_overhead(engines, source: TokenSource, args) -> dict[str, float]:
    wall: dict[bool, list[float]] = {False: [], True: []}
    cache_share = []
    for _ in range(args.overhead_repeats):
        arrivals = distinct_arrivals(source, args.distinct_requests, (64, 384), 32)
        for on, engine in engines.items():
            engine.reset()
            records = drive(engine.engine, arrivals)
            wall[on].append(max(r.finished for r in records))
            if on:
                cache_share.append(engine.cache_s / engine.step_s)
    off, on = statistics.median(wall[False]), statistics.median(wall[True])
    say(f"overhead: off {off:.2f} s, on {on:.2f} s")
    return {"off": off, "on": on, "cache_share": max(cache_share), "runs": wall}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    engines = build_engines(args)
    tokenizer = engines[False].engine.tokenizer
    source = TokenSource(tokenizer, engines[False].engine.model_config.vocab_size, args.seed)
    rag = run_rag(engines, source, args)
    chat = run_chat(engines, source, args)
    overhead = run_overhead(engines, source, args)
    text = build_report(args, machine, rag, chat, overhead)
    print(text)
    if not args.quick:
        args.output.write_text(text)
        say(f"wrote {args.output.name}")


if __name__ == "__main__":
    main()
