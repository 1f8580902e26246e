"""Fixtures of the end-to-end tests: an openai client and the served model's id for the tests
that talk to the session's `pdserve serve` on the default model (tests/conftest.py's
pdserve_server), and `qwen3_reasoning_server`, a tiny Qwen3 served the way a thinking model is
(`--reasoning-parser qwen3`, a Qwen3-style chat template), for the clients that read thinking."""

from __future__ import annotations

import openai
import pytest

from pdserve.commands.serve_process import ServeProcess
from tests.text.test_template_options import TEMPLATE  # Qwen3-style, with enable_thinking


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
