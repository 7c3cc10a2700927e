"""Tiny checkpoints as fixtures, by model family, apart from tests/conftest.py: conftest imports
the serving stack's clients (openai, redis), which a GPU machine need not have, so the GPU runs
load these alone (`pytest -m gpu --noconftest -p tests.model_fixtures`); conftest re-exports them.

`family` is the model family a test runs on: DeepSeek-V4 unless the test is parametrized over
families, `@families()` for a case every family shares, `@families("deepseek_v32")` for one
family's own (indirect: `tiny` and `release` are then that family's checkpoints). What differs
between families in every module (the package, its tiny checkpoints, the HF reference) is
`Family`'s; what one module expects of each family, that module's table keyed by the family's
name. A new family is one more row of FAMILIES, and of those tables.

pytest keeps one instance of a module fixture at a time: where a module runs some tests on the
default family and others on another, the other family's come last (or every test names its
family), or the default family's module fixtures (a serving stack...) are built twice.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@dataclass(frozen=True)
class Family:
    """A model family as the tests meet it."""

    name: str  # the checkpoint's model_type: its package is dsaserve.engine.models.<name>
    hf_reference: str  # the tests' module that builds HF transformers' model of it

    def __str__(self) -> str:
        return self.name

    @property
    def package(self) -> ModuleType:
        """ModelConfig, build_model, load_weights (engine.models' family interface)."""
        return importlib.import_module(f"dsaserve.engine.models.{self.name}")

    @property
    def tiny(self) -> ModuleType:
        """The tiny random checkpoints: make_tiny_model, tiny_config, release_tiny_config."""
        return importlib.import_module(f"dsaserve.engine.models.{self.name}.tiny")

    @property
    def hf(self) -> ModuleType:
        """VOCAB, make_hf_checkpoint (a random HF checkpoint saved with save_pretrained)."""
        return importlib.import_module(self.hf_reference)

    def make_tiny_model(self, out_dir: str | Path, **kwargs: Any) -> Path:
        return self.tiny.make_tiny_model(out_dir, **kwargs)


FAMILIES = {
    f.name: f
    for f in (
        Family("deepseek_v4", "tests.hf_reference"),
        Family("deepseek_v32", "tests.hf_reference_v32"),
    )
}
DEFAULT_FAMILY = "deepseek_v4"  # a test that names none


def families(*names: str) -> pytest.MarkDecorator:
    """Run the test once per family named (none named: every family), as its `family`."""
    return pytest.mark.parametrize("family", names or list(FAMILIES), indirect=True)


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest) -> Family:
    """The family the test is parametrized with (`families`), DeepSeek-V4 if none."""
    return FAMILIES[getattr(request, "param", DEFAULT_FAMILY)]


@pytest.fixture(scope="module")
def tiny(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random dense checkpoint of the family (its tiny.make_tiny_model), one per module;
    served under its directory's name, tiny-<family>."""
    return family.make_tiny_model(tmp_path_factory.mktemp("tiny") / f"tiny-{family}")


@pytest.fixture(scope="module")
def release(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint of the family in its release's layout (V4: FP8 and FP4 weights,
    V3.2: FP8 with weight_scale_inv; an MTP layer, a padded vocabulary), one per module; served
    under its directory's name, tiny-release-<family>."""
    return family.make_tiny_model(
        tmp_path_factory.mktemp("release") / f"tiny-release-{family}", fmt="release"
    )
