"""Users' models as they write them (issue #44), each copied from docs/model-contract.md into a folder outside the
repository: lazy layers shaped by the first batch, and the model's own optimizer and schedule (Lightning's
`configure_optimizers`), each killed mid-run and resumed to the uninterrupted run's weights bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from shardline.core.config import ModelConfig
from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint
from shardline.trainer.contract import ModelContractError, materialize, own_optimizer
from shardline.trainer.models import legacy_data_spec, model_spec_for
from tests.test_resume_kill import CARDS, N_CLASSES, WINDOW, Child, assert_same_as_reference, name, run, shards

__all__ = ["run", "shards"]  # the fixtures, shared with tests/test_resume_kill.py

DOC = Path(__file__).resolve().parents[1] / "docs" / "model-contract.md"


def doc_model(cls: str) -> str:
    """The code block of docs/model-contract.md that defines `cls`, as a user would copy it."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    (found,) = [b for b in blocks if f"class {cls}(" in b]
    return found


def user_spec(folder: Path, cls: str) -> dict:
    """The user's repository at `folder` with the doc's `cls` in models/own.py; the model spec naming it."""
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "__init__.py").write_text("")
    (folder / "models" / "own.py").write_text(doc_model(cls))
    model = ModelConfig(entrypoint=f"models.own:{cls}", code_dir=str(folder))
    return model_spec_for(model, legacy_data_spec(2, CARDS, WINDOW, N_CLASSES))


def killed_and_resumed(run, tmp_path, spec: dict, hold: int, reference) -> Path:
    folder = tmp_path / "ckpt"
    child = run("killed", folder, hold_at_step=hold, model_spec=spec)
    child.wait_for(f"held {hold}")
    child.kill()
    saved = latest_checkpoint(str(folder))[1]["step"]
    assert 0 < saved < hold
    result = run("resume", folder, model_spec=spec).finish()
    assert Path(result["resumed_from"]).name == name(saved)
    assert_same_as_reference(result, reference, folder)
    return folder


def uninterrupted(tmp_path_factory, shards, cls: str) -> tuple[dict, tuple[dict, dict]]:
    """The doc's model `cls` in a user's folder: (its spec, (its uninterrupted run's result, last checkpoint))."""
    spec = user_spec(tmp_path_factory.mktemp(f"{cls}-repo"), cls)
    tmp = tmp_path_factory.mktemp(f"{cls}-reference")
    result = Child(tmp, shards, tmp / "ckpt", "reference", model_spec=spec).finish()
    return spec, (result, load_checkpoint(result["last_checkpoint"]))


@pytest.fixture(scope="module")
def lazy(tmp_path_factory, shards) -> tuple[dict, tuple[dict, dict]]:
    return uninterrupted(tmp_path_factory, shards, "LazyMLP")


def test_a_model_of_lazy_layers_trains_and_resumes_after_a_kill_to_the_same_weights(run, tmp_path, lazy):
    spec, reference = lazy
    weights = reference[1]["model"]
    assert weights["body.1.weight"].shape == (32, WINDOW * (2 + 4 * len(CARDS)))  # its width, from the batch
    assert weights["heads.target.weight"].shape == (N_CLASSES, 32)
    killed_and_resumed(run, tmp_path, spec, 17, reference)


@pytest.fixture(scope="module")
def two_rates(tmp_path_factory, shards) -> tuple[dict, tuple[dict, dict]]:
    return uninterrupted(tmp_path_factory, shards, "TwoRates")


def test_a_model_s_own_optimizer_and_schedule_train_and_resume_after_a_kill_exactly(run, tmp_path, two_rates):
    spec, reference = two_rates
    result, ckpt = reference
    steps = result["steps"]
    # the model's SGD, its two groups at their own rates, halved every 25 steps by its StepLR (stepped each step)
    groups = ckpt["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([0.01 * 0.5 ** (steps // 25), 0.1 * 0.5 ** (steps // 25)])
    assert all(g["momentum"] == 0.9 for g in groups)
    assert ckpt["scheduler"]["last_epoch"] == steps
    assert result["history"][-1]["lr"] == pytest.approx(0.01 * 0.5 ** ((steps - 1) // 25))
    folder = killed_and_resumed(run, tmp_path, spec, 31, reference)
    assert load_checkpoint(str(latest_checkpoint(str(folder))[0]))["scheduler"] == ckpt["scheduler"]


class _Tiny(nn.Module):
    def __init__(self, answer=None):
        super().__init__()
        self.used, self.unused = nn.LazyLinear(3), nn.LazyLinear(2)
        self.answer = answer

    def forward(self, cont, cat):
        return {"target": self.used(cont.flatten(1))}

    def configure_optimizers(self):
        return self.answer(self)


def test_what_a_lazy_layer_or_configure_optimizers_gets_wrong_is_said_before_the_first_step():
    with pytest.raises(ModelContractError, match=r"lazy layer\(s\) unused.weight, unused.bias still have no shape"):
        materialize(_Tiny(), torch.zeros(2, 4, 2), torch.zeros(2, 4, 1, dtype=torch.long), torch.device("cpu"))

    model = nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 5)
    for answer, said in (
        (lambda m: [sgd, sgd], r"returned list, not one optimizer"),
        (lambda m: {"lr_scheduler": None}, r"returned dict, not one optimizer"),
        (lambda m: (sgd, plateau), r"ReduceLROnPlateau, which needs a metric"),
        (lambda m: (sgd, other), r"the scheduler steps another optimizer"),
        (lambda m: {"optimizer": sgd, "lr_scheduler": {"scheduler": other, "interval": "batch"}}, r"another"),
    ):
        tiny = _Tiny(answer)
        with pytest.raises(ModelContractError, match=said):
            own_optimizer(tiny)
    step = torch.optim.lr_scheduler.StepLR(sgd, 5)
    assert own_optimizer(_Tiny(lambda m: sgd)) == (sgd, None, "epoch")
    assert own_optimizer(_Tiny(lambda m: ([sgd], [step]))) == (sgd, step, "epoch")
    assert (
        own_optimizer(_Tiny(lambda m: {"optimizer": sgd, "lr_scheduler": {"scheduler": step, "interval": "step"}}))[2]
        == "step"
    )


def test_the_packages_a_model_imports_are_found_in_its_source_and_a_bare_requirement_is_refused(tmp_path):
    from shardline.core.config import ConfigError, validate_config
    from shardline.core.version import user_packages
    from tests.conftest import tiny_config

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "net.py").write_text(
        "import os\nimport numpy as np\nfrom einops import rearrange\nfrom models.parts import block\n"
        "from . import parts\nimport shardline\n\n\ndef f():\n    import mamba_ssm.modules\n"
    )
    (tmp_path / "models" / "parts.py").write_text("import json\nimport roman\n\nblock = 1\n")
    found = user_packages("models.net:Net", str(tmp_path))
    assert found == {"numpy", "einops", "mamba_ssm", "roman"}  # not os, json, the user's own, nor shardline

    cfg = tiny_config(str(tmp_path / "*.parquet"), str(tmp_path / "store"))
    for bad, said in (("roman", r"'roman' names no version: pin it \('roman==X.Y'\)"), ("x y z", "not a pip")):
        with pytest.raises(ConfigError, match=said):
            validate_config({**cfg, "model": {**cfg["model"], "requirements": [bad]}})
    good = validate_config({**cfg, "model": {**cfg["model"], "requirements": ["roman==5.2", "einops>=0.8"]}})
    assert good.model.requirements == ["roman==5.2", "einops>=0.8"]


def test_a_package_the_model_imports_only_if_it_is_there_is_no_requirement_nor_a_warning(tmp_path, caplog):
    """`try: import einops except ImportError: ...`: where it is not installed the model trained without it, so the
    registered model neither installs it nor warns that it does not (it warned to add it to model.requirements)."""
    import logging

    from shardline.core.config import ModelConfig
    from shardline.runs.model_code import requirements

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "net.py").write_text(
        "import numpy\ntry:\n    import not_installed_anywhere_xyz\nexcept ImportError:\n    pass\n"
    )
    model = ModelConfig(entrypoint="models.net:Net", code_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="shardline.register"):
        pinned = requirements(model)
    assert any(p.startswith("numpy==") for p in pinned) and not any("not_installed" in p for p in pinned)
    assert "not_installed_anywhere_xyz" not in caplog.text


def test_a_model_param_the_model_does_not_take_is_refused_before_any_work(tmp_path):
    """`model.params.n_layers` for a model whose __init__ takes `layers`: check-config passed it and `shardline run`
    failed after the ingest and the encode, with exit 1. Now both exit 2 at once, naming the param and the closest."""
    import subprocess
    import sys

    import yaml

    from tests.conftest import tiny_config

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self, spec, hidden=8, layers=1):\n        super().__init__()\n"
        "    def forward(self, cont, cat):\n        return {}\n"
    )
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"))
    cfg["model"] = {"entrypoint": "models.net:Net", "params": {"hidden": 16, "layerz": 2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    for command in ("check-config", "run"):
        done = subprocess.run(
            [sys.executable, "-m", "shardline", command, str(tmp_path / "c.yaml")],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "cannot be called as Net(spec, **model.params=" in done.stderr, done.stderr
        assert "did you mean model.params.layers (for layerz)?" in done.stderr, done.stderr
    assert not (tmp_path / "store").exists()  # no work done
