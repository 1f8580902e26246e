"""Fixtures shared by the router tests: the tiny model's tokenizer (text/, no torch)."""

from __future__ import annotations

import pytest

from pdserve.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)
