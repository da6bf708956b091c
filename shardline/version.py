"""The version of Shardline's code: a hash of every source file, so a change anywhere shows."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

PACKAGES = ("shardline", "tasks", "trainer", "flows")


@lru_cache(maxsize=None)
def code_version(*packages: str) -> str:
    """sha256 (16 hex) over the .py files of the given packages (all of Shardline by default)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in packages or PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]
