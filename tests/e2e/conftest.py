"""Fixtures of the end-to-end tests that talk to the session's `pdserve serve` on the default
model (tests/conftest.py's pdserve_server): an openai client and the served model's id."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(pdserve_server):
    return openai.OpenAI(base_url=f"{pdserve_server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id
