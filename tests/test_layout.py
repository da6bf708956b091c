"""The storage root's folders are named in one module (shardline/core/layout.py): no writer, nor gc, spells one."""

from __future__ import annotations

import re
from pathlib import Path

from shardline.core import layout

ROOT = Path(__file__).resolve().parents[1]
NAMES = [layout.DATASETS, layout.GROUPS, layout.RUNS, layout.RESULTS, layout.MLFLOW_ARTIFACTS, layout.SWEEPS,
         layout.TOKENIZERS, layout.LOCKS, layout.REHEARSALS, layout.DOCTOR]  # fmt: skip


def test_no_module_but_layout_spells_a_folder_of_the_storage_root():
    names = "|".join(re.escape(n) for n in NAMES)
    # a folder name as a part of a storage path (storage.join(root, "runs", ...), Path(...) / "runs")
    spelled = re.compile(rf"""(?:storage\.join\([^)\n]*|/ )["']({names})["'/]""")
    found = {}
    for path in (ROOT / "shardline").rglob("*.py"):
        if path.name == "layout.py":
            continue
        hits = spelled.findall(path.read_text())
        if hits:
            found[path.relative_to(ROOT).as_posix()] = hits
    assert found == {}, f"storage root folders spelled outside shardline/core/layout.py: {found}"


def test_the_layout_names_what_the_docstring_draws():
    drawn = layout.__doc__
    for name in NAMES:
        assert f"/{name}/" in drawn, name
