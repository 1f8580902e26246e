"""An engine its owner drops is freed at once, by reference counting alone: no reference cycle
holds its runner, its model or its KV cache until the cyclic garbage collector happens to run
(each CPU engine's cache is 1 GiB by default, and a process that made a few engines in a row
held them all). Checked with the collector off, for the engines with compiled CPU steps too.

Once per process: the engine during which numba first compiles a kernel (its on-disk cache
cold) stays alive, held through the frames of that compile (seen with a fresh NUMBA_CACHE_DIR,
as on a fresh clone). So a first engine of the same settings compiles them before the one
checked."""

from __future__ import annotations

import gc
import weakref

import pytest

from pdserve.engine import LLM, SamplingParams


@pytest.mark.parametrize(
    "settings", [{"dtype": "float32"}, {"dtype": "float32", "quantization": "int8"}],
    ids=["fp32", "int8"],
)
def test_a_dropped_engine_is_freed_without_the_cyclic_collector(tiny_llama_dir, settings):
    def run() -> LLM:
        llm = LLM(str(tiny_llama_dir), kv_cache_memory=1 << 24, **settings)
        llm.generate([[5, 6, 7]], [SamplingParams(max_tokens=3, temperature=0.0)])
        return llm

    run()  # compiles what a cold cache lacks
    gc.collect()
    gc.disable()
    try:
        llm = run()
        runner = llm.engine.runner
        assert runner.one_token_step is not None  # the compiled step's views are freed too
        engine, model, cache = (
            weakref.ref(llm.engine), weakref.ref(runner.model), weakref.ref(runner.kv_cache)
        )
        del llm, runner
        assert engine() is None and model() is None and cache() is None
    finally:
        gc.enable()
