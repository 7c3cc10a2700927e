"""dsaserve's tests, by folder: kernels/, models/, text/, engine/, services/, e2e/ (the whole
stack as processes), bench/ (benches' smoke runs); the kits they share sit here (fixtures in
conftest.py, the model families and their tiny checkpoints in model_fixtures.py, serving stacks,
engine and kernel cases, the models' references). A case every family shares is one test
parametrized by `family` (model_fixtures.families), not a copy per family. Errors are measured
with bench.compare.rel_err, the benches' own measure."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
