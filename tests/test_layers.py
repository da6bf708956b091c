"""The layers, read from the code's own imports: each folder of `shardline/` imports only the ones
below it (function-level imports included), no modules import each other, and `trainer/` (plain
PyTorch, runnable by torchrun alone) and `core/` reach neither Prefect nor, for `trainer/`, MLflow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardline.core import version

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardline"
# top to bottom; a module directly in shardline/ (the compatibility re-export, __main__) is the top
LAYERS = ["app", "flows", "tasks", "runs", "launch", "trainer", "core"]
TOP = "app"
FORBIDDEN = {"trainer": ("prefect", "mlflow"), "core": ("prefect",)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else TOP


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement in the file, wherever the statement is (the parser the
    cache keys use, shardline/core/version.py)."""
    return version.imports_of(path, module_name(path))


def project_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # `from shardline.core import storage` names shardline.core and shardline.core.storage: keep
        # the deepest module that exists, and never the bare package `shardline`
        graph[name] = {m for m in imports_of(path) if m in files and m != "shardline" and m != name}
    return graph


def test_every_module_sits_in_a_layer():
    stray = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name not in {*LAYERS, "configs", "__pycache__"}]
    assert not stray, f"folders of shardline/ that are no layer: {stray}"


def test_no_import_runs_upward():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for module, imported in project_graph().items():
        mine = layer_of(module)
        for other in imported:
            theirs = layer_of(other)
            if other.count(".") >= 1 and rank[theirs] < rank[mine]:
                upward.append(f"{module} ({mine}) imports {other} ({theirs})")
    assert not upward, "imports that run upward across the layers:\n  " + "\n  ".join(sorted(upward))


def test_no_import_cycle():
    graph = project_graph()
    # an `__init__` that re-exports its own package's modules lazily is part of them, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m == name.rpartition(".")[0] and m != "shardline")}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "modules that import each other:\n  " + "\n  ".join(cycles)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_need_no_orchestrator(layer):
    """Static: no module of the layer, nor any project module it reaches, names the forbidden packages."""
    graph = project_graph()
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    bad = []
    for start in (m for m in graph if layer_of(m) == layer):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo.extend(graph[m])
            for imp in imports_of(files[m]):
                if imp.split(".")[0] in FORBIDDEN[layer]:
                    bad.append(f"{start} reaches {imp} (through {m})")
    assert not bad, f"shardline/{layer}/ must not import {FORBIDDEN[layer]}:\n  " + "\n  ".join(sorted(set(bad)))


def test_trainer_imports_without_prefect_or_mlflow():
    """At run time too: every trainer module imports in an interpreter where prefect and mlflow cannot
    be imported (as on a bare GPU machine running torchrun)."""
    modules = sorted(module_name(p) for p in (PACKAGE / "trainer").rglob("*.py"))
    code = (
        "import sys\n"
        "for blocked in ('prefect', 'mlflow'):\n"
        "    sys.modules[blocked] = None\n"
        f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a core module that imports a flow is reported."""
    import shutil

    fake_root = tmp_path / "repo"
    shutil.copytree(PACKAGE, fake_root / "shardline", ignore=shutil.ignore_patterns("__pycache__"))
    bad = fake_root / "shardline" / "core" / "storage.py"
    bad.write_text(bad.read_text() + "\n\ndef _late():\n    from shardline.flows.pipeline import pipeline\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake_root / "shardline")
    with pytest.raises(AssertionError, match=r"shardline.core.storage \(core\) imports shardline.flows.pipeline"):
        test_no_import_runs_upward()


def test_importing_the_pipeline_does_not_import_torch():
    """A fully cached rerun never trains: the pipeline's import must not pay torch's start-up (~3 s);
    the steps that need it import it when they run."""
    code = "import sys, shardline.flows.pipeline\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]
