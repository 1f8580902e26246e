"""Fixtures of the end-to-end tests: `pdserve_process` (`pdserve serve` on the default model, shared
by this folder's tests), an openai client and the served model's id for the tests that talk to
it, and `qwen3_reasoning_server`, a tiny Qwen3 served the way a thinking model is
(`--reasoning-parser qwen3`, a Qwen3-style chat template), for the clients that read thinking."""

from __future__ import annotations

import openai
import pytest

from pdserve.commands.serve_process import ServeProcess
from tests.text.test_template_options import TEMPLATE  # Qwen3-style, with enable_thinking


@pytest.fixture(scope="package")
def pdserve_process(default_model_dir, tmp_path_factory):
    """`pdserve serve` on the default model (router, prefill node, decode node), as real
    processes; they all write to the file `log_path`, which tests read to wait for events.
    Started by the first test of this folder that asks for it, stopped after the folder's last
    test: its 3.9 GB are not held through the rest of the suite."""
    log_path = tmp_path_factory.mktemp("pdserve-serve") / "serve.log"
    server = ServeProcess(
        ["--model", str(default_model_dir), "--dtype", "float32", "--kv-cache-memory",
         str(256 << 20)],
        ready_timeout_s=240,
        log_path=log_path,
    )
    server.log_path = log_path
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="package")
def pdserve_server(pdserve_process) -> str:
    """The URL of `pdserve_process`."""
    return pdserve_process.url


@pytest.fixture(scope="module")
def client(pdserve_server):
    return openai.OpenAI(base_url=f"{pdserve_server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def qwen3_reasoning_server(tmp_path_factory):
    """`pdserve serve --reasoning-parser qwen3` (colocated, fp32) on a tiny random-weight Qwen3
    whose template switches thinking off on `enable_thinking: false`; its URL."""
    from pdserve.testing.tiny_models import save_tiny_model

    folder = save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))
    server = ServeProcess(
        ["--model", str(folder), "--colocated", "--dtype", "float32", "--reasoning-parser",
         "qwen3", "--chat-template", TEMPLATE], ready_timeout_s=240,
    )
    try:
        yield server.url
    finally:
        server.close()
