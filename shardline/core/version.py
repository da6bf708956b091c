"""Versions of code, Shardline's and the user's model code, for cache keys and lineage tags.

`code_version_of("shardline.core.encoding.write")` hashes that module and every project module it imports,
directly or not (function-level imports included): a change to it or to any code it calls changes its version; a
change elsewhere does not. A cache key holds the version of the code that computes the output, not of the code
that only displays or reports it (`trainer_version`; the encode's `encoder_code`).
"""

from __future__ import annotations

import ast
import hashlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

PACKAGES = ("shardline",)
ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the `shardline` package
# ast.parse from several threads at once can fail in CPython 3.11 ("SystemError: AST constructor
# recursion depth mismatch"): mapped tasks compute their cache keys concurrently, so parse one at a time
_PARSE = threading.Lock()


@contextmanager
def spawning_this_shardline() -> Iterator[None]:
    """Within the block, `sys.path` holds no folder with another `shardline` package than this one: processes started
    meanwhile by multiprocessing's spawn or fork server (Dask's local workers, a sweep's trials) take this `sys.path`
    and import Shardline through it. A model MLflow loaded in this process left its code folder, which carries a copy
    of Shardline's predicting modules (tasks/register.py), first on it for good: those processes imported Shardline
    from that copy, another version's or one missing the modules they run."""
    mine = (ROOT / "shardline").resolve()

    def other(entry: str) -> bool:
        package = Path(entry or ".") / "shardline"
        return (package / "__init__.py").is_file() and package.resolve() != mine

    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not other(p)]
    try:
        yield
    finally:
        sys.path[:] = saved


def _module_path(name: str, root: Path, packages: tuple[str, ...] | None) -> Path | None:
    """The source file of module `name` under `root` (only those of `packages`, when given)."""
    parts = name.split(".")
    if not name or (packages is not None and parts[0] not in packages):
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


DYNAMIC = "<dynamic>"  # in `imports_of`: the file imports a module whose name is computed at run time


def imports_of(path: Path, module: str) -> set[str]:
    """Every module an import statement in `path` (module `module`) names, wherever the statement is, and those an
    `importlib.import_module` or `__import__` call names in a string; `DYNAMIC` where such a call's name is computed
    (a model whose config picks its core: `import_module(f"models.{name}")`). Parsed once per version of the file in a
    process (the step keys' closures share most of their files)."""
    st = path.stat()
    return set(_imports_of(path, module, st.st_mtime_ns, st.st_size))


@cache
def _imports_of(path: Path, module: str, mtime_ns: int, size: int) -> frozenset[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    with _PARSE:
        tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _imports_by_name(node.func) and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):  # import_module(".blocks", __package__)
                bare = name.value.lstrip(".")
                found.add(_absolute(bare, len(name.value) - len(bare), package))
            else:
                found.add(DYNAMIC)
    return frozenset(found)


def _absolute(name: str, level: int, package: str) -> str:
    """A module name as imported from `package`: `name` itself, or with `level` leading dots, below the package
    `level` - 1 levels up."""
    if not level:
        return name
    anchor = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join([*anchor, name] if name else anchor)


def _imports_by_name(func: ast.expr) -> bool:
    """`importlib.import_module`, `import_module` or `__import__`: a call that imports the module its argument names."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _closure(module: str, root: Path, packages: tuple[str, ...] | None) -> dict[str, Path]:
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_path(name, root, packages)
        if path is None or name in seen:
            continue
        seen[name] = path
        todo.extend(imports_of(path, name))
    return seen


@cache
def module_closure(module: str) -> tuple[Path, ...]:
    """The project source files `module` depends on (itself included), sorted."""
    return tuple(sorted(set(_closure(module, ROOT, PACKAGES).values())))


def user_code(entrypoint: str, code_dir: str | None) -> dict[str, Path]:
    """The user's source files a model entrypoint ("package.module:Name") depends on: its module and every
    module under `code_dir` (default the working directory) it imports, directly or not, by module name (an
    `importlib.import_module("models.blocks")` included; where one such name is computed, every module of the
    packages they lie in). Not cached: the user edits these files between runs of one process."""
    root = Path(code_dir or Path.cwd()).resolve()
    module = entrypoint.partition(":")[0]
    parts = module.split(".")  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
    code = {k: v for i in range(1, len(parts) + 1) for k, v in _closure(".".join(parts[:i]), root, None).items()}
    if any(DYNAMIC in imports_of(path, name) for name, path in code.items()):
        # a module imported by a name computed at run time could be any of its packages' modules: all of them count
        for top in {root / name.partition(".")[0] for name in code}:
            for path in sorted(top.rglob("*.py")) if top.is_dir() else []:
                rel = path.relative_to(root)
                if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                    continue
                name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
                for k, v in _closure(name, root, None).items():
                    code.setdefault(k, v)
    return code


def user_packages(entrypoint: str, code_dir: str | None) -> set[str]:
    """The top-level modules the user's model code imports that are neither the user's own (under `code_dir`),
    the standard library's, nor Shardline: the third-party packages a registered model must install."""
    code = user_code(entrypoint, code_dir)
    own = {name.partition(".")[0] for name in code}
    found = {name.partition(".")[0] for module, path in code.items() for name in imports_of(path, module)}
    found = {n for n in found if n.isidentifier()}  # not `DYNAMIC`
    return {n for n in found if n not in own and n not in sys.stdlib_module_names and n != "shardline"}


def user_code_version(entrypoint: str, code_dir: str | None) -> str:
    """A hash of the user's model code (`user_code`) and of the data files in its packages (a vocabulary, a
    table the model reads: they travel with the registered model): an edit to any of those files changes it."""
    root = Path(code_dir or Path.cwd()).resolve()
    code = user_code(entrypoint, code_dir)
    tops = {root / name.partition(".")[0] for name in code}
    data = {
        f"{path.relative_to(root)}": path
        for top in tops
        if top.is_dir()
        for path in top.rglob("*")
        if path.is_file()
        and path.suffix not in (".py", ".pyc")
        and not any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts)
    }
    h = hashlib.sha256(entrypoint.encode())
    for name, path in [*sorted(code.items()), *sorted(data.items())]:
        h.update(f"\0{name}\0{path.relative_to(root)}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@cache
def code_version_of(*modules: str) -> str:
    return _digest(sorted({p for m in modules for p in module_closure(m)}))


# the code that decides a trained model's weights and scores: the trainer (its loop, step, models, loader,
# checkpoints, the body of a training in several processes) and what it imports. Not the training run's
# bookkeeping around it (MLflow, the Prefect view, cost, links): an edit there trains nothing again. The train
# step's cache key and a run's folder are keyed on it.
TRAINER = ("shardline.trainer.loop", "shardline.trainer.ddp_run")


def trainer_version() -> str:
    """The version of the code that trains (`TRAINER`)."""
    return code_version_of(*TRAINER)


@cache
def code_version() -> str:
    """The whole project's code version (every source file)."""
    return _digest([path for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))])
