"""Versions of Shardline's code, for cache keys and lineage tags.

`code_version_of("shardline.tasks.encode")` hashes that module and every project module it imports, directly
or not (function-level imports included): a change to the step or to any code it calls changes
its version; a change elsewhere does not.
"""

from __future__ import annotations

import ast
import hashlib
import threading
from functools import cache
from pathlib import Path

PACKAGES = ("shardline",)
ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `shardline` package
# ast.parse from several threads at once can fail in CPython 3.11 ("SystemError: AST constructor
# recursion depth mismatch"): mapped tasks compute their cache keys concurrently, so parse one at a time
_PARSE = threading.Lock()


def _module_path(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    with _PARSE:
        tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@cache
def module_closure(module: str) -> tuple[Path, ...]:
    """The project source files `module` depends on (itself included), sorted."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_path(name)
        if path is None or name in seen:
            continue
        seen[name] = path
        todo.extend(_imports(path, name))
    return tuple(sorted(set(seen.values())))


@cache
def code_version_of(*modules: str) -> str:
    h = hashlib.sha256()
    files = sorted({p for m in modules for p in module_closure(m)})
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@cache
def code_version() -> str:
    """The whole project's code version (every source file)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]
