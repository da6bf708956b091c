"""What an edit to Shardline's own code costs a user: the train step's cache key and a run's folder are keyed on the
code that trains, and a file group's address on the code that writes its bytes; an edit to code that only displays
or reports (the Prefect progress table, an encode log line) reruns nothing, an edit to the loss retrains and an edit
to the encoding re-encodes.

Each edit is made to a copy of the package; the versions are read from that copy as the pipeline reads them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardline.core import version

PACKAGE = Path(version.__file__).resolve().parents[1]


def versions(monkeypatch, root: Path) -> dict[str, str]:
    """What keys a run's folder and the train cache (`trainer_version`), and a group's address (`encoder_code`),
    for the package copy under `root`."""
    from shardline.tasks.encode import ENCODE_GROUP_CACHE, encoder_code

    monkeypatch.setattr(version, "ROOT", root)
    version.module_closure.cache_clear()
    version.code_version_of.cache_clear()
    try:
        # a group's address, and the encode step's Prefect cache key (the step reruns, or is Cached)
        encode = (encoder_code(), version.code_version_of(*ENCODE_GROUP_CACHE.code))
        return {"train": version.trainer_version(), "encode": encode}
    finally:
        version.module_closure.cache_clear()
        version.code_version_of.cache_clear()


def edited(tmp_path: Path, name: str, module: str, old: str, new: str) -> Path:
    root = tmp_path / name
    shutil.copytree(PACKAGE, root / "shardline", ignore=shutil.ignore_patterns("__pycache__"))
    path = root / "shardline" / module
    text = path.read_text()
    assert old in text, f"{module} no longer holds {old!r}: pick another line to edit"
    path.write_text(text.replace(old, new, 1))
    return root


EDITS = [
    # (file, text, replacement, train step reruns, groups re-encode)
    ("runs/training_view.py", '"optimizer steps done (%)"', '"optimizer steps finished (%)"', False, False),
    ("tasks/encode.py", '"encode: group %d/%d %s:', '"encode: file group %d/%d %s:', False, False),
    (
        "trainer/contract.py",
        "F.cross_entropy(out, y.long(), reduction=reduction)",
        "F.cross_entropy(out, y.long(), reduction=reduction, label_smoothing=0.1)",
        True,
        False,
    ),  # fmt: skip
    # the encoding: new groups (and the manifest's new hash gives the training a new run folder)
    ("core/encoding/group.py", "RANGE_IDS = 255", "RANGE_IDS = 127", False, True),
]


@pytest.mark.parametrize("module, old, new, retrains, reencodes", EDITS)
def test_an_edit_reruns_only_the_steps_whose_output_it_changes(
    tmp_path, monkeypatch, module, old, new, retrains, reencodes
):
    before = versions(monkeypatch, edited(tmp_path, "before", module, old, old))
    after = versions(monkeypatch, edited(tmp_path, "after", module, old, new))
    assert (after["train"] != before["train"]) is retrains, module
    assert (after["encode"] != before["encode"]) is reencodes, module


def test_the_run_folder_is_keyed_on_the_trainer_version(monkeypatch):
    """`run_dir` and the train step's cache rule take the trainer's version, not the train step's whole import
    closure (48 modules, the progress table, MLflow links and cost among them)."""
    from shardline.tasks.train import TRAIN_CACHE

    assert TRAIN_CACHE.code == version.TRAINER
    files = {p.relative_to(PACKAGE).as_posix() for m in version.TRAINER for p in version.module_closure(m)}
    assert "trainer/contract.py" in files and "runs/training_view.py" not in files
    assert not {f for f in files if f.startswith(("app/", "flows/", "tasks/", "runs/", "launch/"))}


def test_a_users_model_version_covers_its_packages_init_and_data_files_and_nothing_else(tmp_path):
    """What trains again after an edit to the user's own folder: their model's modules and what they import,
    the `__init__.py` of the packages they lie in (run by every import of them), and the data files in those
    packages (a vocabulary the model reads: it travels with the registered model); not an unrelated module."""
    models = tmp_path / "models"
    (models / "__pycache__").mkdir(parents=True)
    (models / "__init__.py").write_text("SCALE = 1.0\n")
    (models / "world.py").write_text("import json\nfrom models.helpers import width\n")
    (models / "helpers.py").write_text("def width(c):\n    return 4\n")
    (models / "other.py").write_text("X = 1\n")
    (models / "vocab.json").write_text('{"a": 0}')

    def now() -> str:
        return version.user_code_version("models.world:WorldModel", str(tmp_path))

    first = now()
    for path, text, retrains in [
        ("models/__init__.py", "SCALE = 2.0\n", True),
        ("models/vocab.json", '{"a": 1}', True),
        ("models/helpers.py", "def width(c):\n    return 8\n", True),
        ("models/other.py", "X = 2\n", False),
        ("models/__pycache__/world.cpython-311.pyc", "bytes", False),
        (".hidden", "x", False),
    ]:
        (tmp_path / path).write_text(text)
        second = now()
        assert (second != first) is retrains, path
        first = second


def test_a_module_the_model_imports_by_name_at_run_time_is_its_code_too(tmp_path):
    """A core the config picks (`importlib.import_module`): a module named in a string is followed as an import is;
    where the name is computed, every module of the model's packages counts (an edit to the core a run used
    trained nothing again: the run was taken from the cache)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "__init__.py").write_text("")
    (models / "blocks.py").write_text("A = 0.5\n")
    (models / "other.py").write_text("X = 1\n")
    world = models / "world.py"
    world.write_text("import importlib\nMiniSSM = importlib.import_module('models.blocks')\n")

    def now() -> str:
        return version.user_code_version("models.world:WorldModel", str(tmp_path))

    first = now()
    (models / "blocks.py").write_text("A = 0.1\n")
    assert now() != first  # named in a string: followed
    first = now()
    (models / "other.py").write_text("X = 2\n")
    assert now() == first  # not imported
    world.write_text("from importlib import import_module\ncore = lambda name: import_module(f'models.{name}')\n")
    first = now()
    (models / "other.py").write_text("X = 3\n")
    assert now() != first  # a computed name: any module of the package may be the one
    assert "models.other" in version.user_code("models.world:WorldModel", str(tmp_path))
    assert version.user_packages("models.world:WorldModel", str(tmp_path)) == set()  # no package to install
