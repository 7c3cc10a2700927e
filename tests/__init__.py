"""dsaserve's tests, by folder: kernels/, models/, text/, engine/, services/, e2e/ (the whole
stack as processes), bench/ (benches' smoke runs); the kits they share sit here (fixtures in
conftest.py, serving stacks, engine and kernel cases, the models' references)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
