"""Tiny checkpoints as fixtures, apart from tests/conftest.py: conftest imports the serving
stack's clients (openai, redis), which a GPU machine need not have, so the GPU runs load these
alone (`pytest -m gpu --noconftest -p tests.model_fixtures`); conftest re-exports them."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random dense V4 checkpoint (engine.models.deepseek_v4.tiny), one per module."""
    from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random V4 checkpoint in the release's FP8/FP4 formats, one per module."""
    from dsaserve.engine.models.deepseek_v4.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("release"), fmt="release")
