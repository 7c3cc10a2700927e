"""The import package as a user installs it, and the house rules of its imports: one top-level
package (`dsaserve`), the offline API at `from dsaserve import LLM, SamplingParams`, imports
pointing one way (services -> engine -> kernels) and no import circle anywhere."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import REPO_ROOT

PACKAGE = REPO_ROOT / "dsaserve"
LAYERS = ("kernels", "engine", "services")  # each may import only those before it


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of the package it imports (at any depth of its code)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {owner(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:  # relative: the same package
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                deps |= {owner(f"{package}.{node.module}.{a.name}") for a in node.names}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _import_graph()
    assert len(graph) > 150  # (the walk found the package)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_one_way_services_engine_kernels() -> None:
    def layer(module: str) -> int | None:
        parts = module.split(".")
        return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None

    upward = [
        (module, dep)
        for module, deps in _import_graph().items()
        for dep in deps
        if (a := layer(module)) is not None and (b := layer(dep)) is not None and b > a
    ]
    assert upward == []


@pytest.mark.e2e  # builds the wheel and runs it in a process of its own
def test_the_wheel_installs_one_package_that_serves_the_offline_api(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO_ROOT)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("dsaserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "dsaserve",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    assert "dsaserve/engine/assets/dsaserve-demo-v4/model.safetensors" in names  # the demo model
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    code = (
        "import importlib.util, sys\n"
        "from dsaserve import LLM, SamplingParams\n"
        "assert LLM.__module__.startswith('dsaserve.'), LLM.__module__\n"
        # `kernels` may exist: it is Hugging Face's kernel hub, which transformers requires.
        # None of the three may come from our install.
        "for generic in ('engine', 'kernels', 'services'):\n"
        "    s = importlib.util.find_spec(generic)\n"
        "    where = [s.origin or '', *(s.submodule_search_locations or [])] if s else []\n"
        "    assert not any(w.startswith(sys.argv[1]) for w in where), s\n"
        "from dsaserve.engine.demo_model import DEMO_MODEL_DIR\n"
        "assert DEMO_MODEL_DIR.is_relative_to(sys.argv[1]), DEMO_MODEL_DIR\n"
        "llm = LLM(DEMO_MODEL_DIR)\n"
        "[out] = llm.generate(['ROMEO:'], SamplingParams(max_tokens=8, temperature=0))\n"
        "assert len(out.token_ids) == 8, out\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
