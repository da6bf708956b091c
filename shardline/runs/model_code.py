"""What a registered model carries besides its weights: the code it runs (Shardline's modules that predicting
imports, and the user's own model code) and the packages it needs, pinned."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

from shardline.core.config import ModelConfig, PipelineConfig
from shardline.core.version import module_closure, user_code, user_packages

logger = logging.getLogger("shardline.register")
PYFUNC_MODULE = "shardline.runs.pyfunc_model"
PYFUNC_CODE = Path(importlib.util.find_spec(PYFUNC_MODULE).origin)  # found, not imported


def requirements(model: ModelConfig) -> list[str]:
    """The packages the registered model imports, pinned to the versions it was trained with: Shardline's, every
    third-party package the user's model code imports (found in its source, mapped to the distribution installed
    here), and `model.requirements`. Shardline itself is not among them (a bare `shardline` could resolve to
    someone else's package): its code and the user's travel inside the model (`code_paths`)."""
    from importlib.metadata import packages_distributions, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    packages = ["torch", "polars", "pyarrow", "numpy", "pandas", "pydantic", "pyyaml", "fsspec", "mlflow"]
    if model.entrypoint:
        provided = packages_distributions()
        for name in sorted(user_packages(model.entrypoint, model.code_dir)):
            dists = provided.get(name)
            if dists:
                packages.extend(dists)
            elif importlib.util.find_spec(name) is None:  # not installed, yet it trained: an optional import
                continue
            else:  # importable when it trained, but no installed distribution provides it
                logger.warning(
                    "register: the model's code imports %s, which no installed package provides: the registered "
                    "model does not install it (name it in model.requirements, pinned)",
                    name,
                )
    pinned = {canonicalize_name(p): f"{p}=={version(p).split('+')[0]}" for p in packages}
    for line in model.requirements:  # the user's own, as written (checked: each names a version)
        pinned[canonicalize_name(Requirement(line).name)] = line
    return list(pinned.values())


SHARDLINE_PACKAGE = Path(__file__).resolve().parents[1]


def _copy_sources(src: Path, dest: Path) -> Path:
    """A copy of a module file or a package folder, its Python sources and data only (no caches)."""
    if src.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
        return dest
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    return dest


def _shardline_sources() -> list[Path]:
    """Shardline's source files a registered model runs: `PYFUNC_MODULE`, every module it imports (directly or
    not, function-level imports included) and the packages they lie in. The rest of Shardline (the pipeline's
    steps, the CLI, the demo's generator: two thirds of its files) never runs where the model predicts; shipped,
    it was uploaded with every version and read back to be checked, a request a file on an object store."""
    files: set[Path] = set()
    todo = [PYFUNC_MODULE]
    while todo:
        for path in module_closure(todo.pop()):
            if path not in files:
                files.add(path)
                parts = path.relative_to(SHARDLINE_PACKAGE.parent).with_suffix("").parts
                todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__
    return sorted(files)


def code_paths(config: PipelineConfig, folder: Path) -> list[str]:
    """The code the registered model runs, copied into it: Shardline's modules that predicting imports
    (`_shardline_sources`), and for the user's own model the top-level modules and packages of its code (its
    entrypoint and what that imports), so the model predicts on a machine that has neither Shardline nor the
    user's repository."""
    for src in _shardline_sources():
        _copy_sources(src, folder / src.relative_to(SHARDLINE_PACKAGE.parent))
    paths = [folder / "shardline"]
    model = config.model
    if model.entrypoint:
        root = Path(model.code_dir or Path.cwd()).resolve()
        for top in sorted({name.split(".")[0] for name in user_code(model.entrypoint, model.code_dir)}):
            src = root / top if (root / top).is_dir() else root / f"{top}.py"
            paths.append(_copy_sources(src, folder / src.name))
    return [str(p) for p in paths]
