"""The model contract at the trainer: a user's model from a folder outside the repository trains like
a built-in one, and every way of breaking the contract fails before a step with a message that names
the entrypoint or the target, what was seen and what was expected."""

from __future__ import annotations

import textwrap

import pytest
import torch

from shardline.core.config import ModelConfig, TrainingConfig
from shardline.trainer.contract import ModelContractError, import_entrypoint
from shardline.trainer.inference import load_model, predict
from shardline.trainer.loop import Callbacks, FitOptions, fit
from shardline.trainer.models import legacy_data_spec, model_from_spec, model_spec_for
from tests.test_trainer import CARDS, N_CLASSES, K, data  # noqa: F401  (the module-scoped `data` fixture)
from tests.user_project import write_project

quiet = lambda *a, **k: None


def train_cfg(**over) -> TrainingConfig:
    base = dict(epochs=1, batch_size=32, lr=1e-2, warmup_steps=2, device="cpu", precision="fp32", seed=0)
    return TrainingConfig(**{**base, **over})


def user_spec(folder, entrypoint="models.world:WindowGRU", **params) -> dict:
    model = ModelConfig(entrypoint=entrypoint, params=params, code_dir=str(folder))
    return model_spec_for(model, legacy_data_spec(2, CARDS, K, N_CLASSES))


def write_module(folder, name: str, source: str) -> None:
    (folder / "models").mkdir(parents=True, exist_ok=True)
    (folder / "models" / "__init__.py").write_text("")
    (folder / "models" / f"{name}.py").write_text(textwrap.dedent(source).lstrip())


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's folder; its `models` package is forgotten after the test (each test writes its own)."""
    import sys

    folder = tmp_path / "proj"
    write_project(folder)
    yield folder
    for name in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
        del sys.modules[name]
    if str(folder) in sys.path:
        sys.path.remove(str(folder))


def test_a_users_model_trains_checkpoints_and_predicts_like_a_built_in(data, project, tmp_path):  # noqa: F811
    spec = user_spec(project, hidden=12)
    result = fit(
        data["classification"],
        data["classification-val"],
        spec,
        train_cfg(),
        "classification",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=quiet),
    )
    model = load_model(result.best_checkpoint)
    assert type(model).__name__ == "WindowGRU" and model.gru.hidden_size == 12  # built as Name(spec, **params)
    probs = predict(model, data["classification-val"])["target"]
    assert probs.shape == (data["classification-val"].n_windows, N_CLASSES)
    assert torch.allclose(torch.from_numpy(probs).sum(1), torch.ones(len(probs)), atol=1e-5)


def test_a_model_with_its_own_loss_trains_on_it(data, project, tmp_path):  # noqa: F811
    write_module(
        project,
        "own",
        """
        import torch
        from torch import nn
        from models.world import WindowGRU

        class Counted(WindowGRU):
            calls = 0

            def loss(self, outputs, cont, cat, targets):
                Counted.calls += 1
                (name,) = targets
                return nn.functional.cross_entropy(outputs[name], targets[name].long()) + 0.0 * cont.sum()
        """,
    )
    spec = user_spec(project, "models.own:Counted")
    fit(
        data["classification"],
        data["classification-val"],
        spec,
        train_cfg(max_steps_per_epoch=4),
        "classification",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=quiet),
    )
    from models.own import Counted

    assert Counted.calls >= 4  # every training step, and the validation batches


@pytest.mark.parametrize(
    "source, expect",
    [
        (
            "return {'other': torch.zeros(cont.shape[0], 4)}",
            r"forward returned \['other'\] but not the declared target\(s\) \['target'\]",
        ),
        (
            "return {'target': torch.zeros(cont.shape[0], 7)}",
            r"output for target 'target' \(classification\) has shape \[\d+, 7\], expected \[\d+, 4\]",
        ),
        ("return [torch.zeros(1)]", r"forward returned a list; it must return a dict"),
        (
            "return {'target': torch.zeros(cont.shape[0], 4, dtype=torch.long)}",
            r"output for target 'target' \(classification\) is int64: it must be floating point",
        ),
        (  # right in training, wrong in eval mode: said at the first validation batch, not by evaluation's reshape
            "return {'target': self.w * torch.zeros(cont.shape[0], 4 if self.training else 3)}",
            r"in eval mode \(validation\): forward's output for target 'target' .* has shape \[\d+, 3\]",
        ),
    ],
    ids=["missing-target", "wrong-shape", "not-a-dict", "integer", "eval-mode-shape"],
)
def test_outputs_that_break_the_contract_fail_on_the_first_batch(data, project, tmp_path, source, expect):  # noqa: F811
    write_module(
        project,
        "bad",
        f"""
        import torch
        from torch import nn

        class Bad(nn.Module):
            def __init__(self, spec):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(1))

            def forward(self, cont, cat):
                {source}
        """,
    )
    with pytest.raises(ModelContractError, match=expect):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project, "models.bad:Bad"),
            train_cfg(),
            "classification",
            str(tmp_path / "ckpt"),
            callbacks=Callbacks(log=quiet),
        )
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not list(ckpt.glob("ckpt-*"))  # no step was taken, nothing written


@pytest.mark.parametrize(
    "init, expect",
    [
        ("pass", r"Still: nothing to train: it has no trainable parameters \(nn.Parameter"),
        (
            "self.w = nn.Parameter(torch.zeros(4)); self.w.requires_grad_(False)",
            r"Still: nothing to train: it has no trainable parameters \(it freezes its own 1\)",
        ),
    ],
    ids=["no-parameters", "all-frozen-by-itself"],
)
def test_a_model_with_nothing_to_train_is_refused_before_its_first_step(data, project, tmp_path, init, expect):  # noqa: F811
    """A model of fixed outputs, or one that freezes all of itself: torch's "element 0 of tensors does not require
    grad" at the first backward, 190 lines of traceback, said as what it is instead."""
    write_module(
        project,
        "still",
        f"""
        import torch
        from torch import nn

        class Still(nn.Module):
            def __init__(self, spec):
                super().__init__()
                {init}

            def forward(self, cont, cat):
                return {{"target": torch.zeros(cont.shape[0], 4)}}
        """,
    )
    with pytest.raises(ModelContractError, match=expect):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project, "models.still:Still"),
            train_cfg(),
            "classification",
            str(tmp_path / "ckpt"),
            callbacks=Callbacks(log=quiet),
        )


def test_attributes_named_loss_or_metrics_are_the_models_own_not_hooks(data, project, tmp_path):  # noqa: F811
    """`self.loss = nn.CrossEntropyLoss()` and `self.metrics = nn.ModuleDict()`, as models are written: the
    default loss and metrics are used (they were called as the model's hooks: a TypeError, then, after a whole
    epoch, ModuleDict's missing forward)."""
    write_module(
        project,
        "attrs",
        """
        import torch
        from torch import nn

        class Attrs(nn.Module):
            def __init__(self, spec):
                super().__init__()
                self.head = nn.Linear(spec.window * spec.n_cont, spec.targets[0].n_classes)
                self.loss = nn.CrossEntropyLoss()
                self.metrics = nn.ModuleDict()

            def forward(self, cont, cat):
                return {"target": self.head(cont.flatten(1))}
        """,
    )
    result = fit(
        data["classification"],
        data["classification-val"],
        user_spec(project, "models.attrs:Attrs"),
        train_cfg(),
        "classification",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=quiet),
    )
    assert "val_accuracy" in result.history[-1]


def test_a_batchnorm_model_with_a_last_batch_of_one_window_names_the_batch_size(data, project, tmp_path):  # noqa: F811
    """torch's "Expected more than 1 value per channel" named no step and no setting."""
    write_module(
        project,
        "normed",
        """
        import torch
        from torch import nn

        class Normed(nn.Module):
            def __init__(self, spec):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(spec.window * spec.n_cont, 8), nn.BatchNorm1d(8))
                self.head = nn.Linear(8, spec.targets[0].n_classes)

            def forward(self, cont, cat):
                return {"target": self.head(self.body(cont.flatten(1)))}
        """,
    )
    n = data["classification"].n_windows
    with pytest.raises(ModelContractError, match=rf"leave 1 after the batches of training.batch_size={n - 1},"):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project, "models.normed:Normed"),
            train_cfg(batch_size=n - 1),
            "classification",
            str(tmp_path / "ckpt"),
            callbacks=Callbacks(log=quiet),
        )


@pytest.mark.parametrize(
    "loss, expect",
    [
        ("torch.ones(3, requires_grad=True)", r"Lossy.loss returned \[3\] at step 1; it must return a scalar tensor"),
        ("torch.tensor(float('nan'), requires_grad=True)", r"Lossy.loss is nan at step 1, .* before any update"),
        (
            None,
            r"the default loss is (inf|nan) at step 1, .*before any update .*: the model's output\(s\) \['target'\]",
        ),
    ],
    ids=["not-a-scalar", "nan", "an-output-of-inf"],
)
def test_a_loss_that_is_not_a_finite_scalar_names_the_step(data, project, tmp_path, loss, expect):  # noqa: F811
    write_module(
        project,
        "lossy",
        f"""
        import torch
        from models.world import WindowGRU

        class Lossy(WindowGRU):
            def loss(self, outputs, cont, cat, targets):
                return {loss}

        class Overflows(WindowGRU):  # the default loss of an output that overflowed
            def forward(self, cont, cat):
                return {{"target": super().forward(cont, cat)["target"] * float("inf")}}
        """,
    )
    with pytest.raises(ModelContractError, match=expect):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project, "models.lossy:Lossy" if loss else "models.lossy:Overflows"),
            train_cfg(),
            "classification",
            str(tmp_path / "ckpt"),
            callbacks=Callbacks(log=quiet),
        )


@pytest.mark.parametrize(
    "metrics, over, expect",
    [
        (  # it replaced the validation's own accuracy, by which the best epoch was then chosen
            "{'accuracy': torch.tensor(0.99)}",
            {},
            r"Measured.metrics returned 'accuracy', the name of a metric Shardline computes itself \(val_accuracy\)",
        ),
        ("{'loss': torch.tensor(123.0)}", {}, r"Measured.metrics returned 'loss', .*\(val_loss\).*'my_loss'"),
        (  # a value per window: it failed after the first epoch, on the last, shorter batch, naming nothing
            "{'per_window': (outputs['target'].argmax(-1) == targets['target']).float()}",
            {},
            r"Measured.metrics returned 'per_window' of shape \[32\]; each value must be a scalar",
        ),
        ("{'hit': 'yes'}", {}, r"Measured.metrics returned 'hit' as a str; each value must be a scalar"),
        (  # the model's own loss is not given the weights: they changed nothing, and trained again for it
            None,
            {"loss_weights": {"target": 2.0}},
            r"training.loss_weights \{'target': 2.0\} weighs the targets of the default loss, which Measured.loss",
        ),
    ],
    ids=["accuracy", "loss", "per-window", "not-a-number", "loss-weights-with-own-loss"],
)
def test_a_models_own_metrics_and_loss_are_checked_before_a_step(data, project, tmp_path, metrics, over, expect):  # noqa: F811
    hook = (
        f"def metrics(self, outputs, cont, cat, targets):\n                return {metrics}"
        if metrics
        else "def loss(self, outputs, cont, cat, targets):\n                return outputs['target'].sum() * 0.0"
    )
    write_module(
        project,
        "measured",
        f"""
        import torch
        from models.world import WindowGRU

        class Measured(WindowGRU):
            {hook}
        """,
    )
    with pytest.raises(ModelContractError, match=expect):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project, "models.measured:Measured"),
            train_cfg(**over),
            "classification",
            str(tmp_path / "ckpt"),
            callbacks=Callbacks(log=quiet),
        )
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not list(ckpt.glob("ckpt-*"))  # no step was taken, nothing written


def test_entrypoints_that_do_not_build_a_module_say_why(project):
    write_module(
        project,
        "odd",
        """
        def not_a_module(spec):
            return 42

        def no_spec():
            return None

        def checks(spec, dropout=0.1):
            if not 0 <= dropout < 1:
                raise ValueError("dropout")
            return None

        VALUE = 3
        """,
    )
    with pytest.raises(ModelContractError, match=r"no module 'nowhere' in .*proj"):
        import_entrypoint("nowhere.world:Net", str(project))
    with pytest.raises(
        ModelContractError, match=r"models.world \(.*world.py\) has no 'Missing'; it defines .*WindowGRU"
    ):
        import_entrypoint("models.world:Missing", str(project))
    with pytest.raises(ModelContractError, match="is a int, not a torch.nn.Module class"):
        import_entrypoint("models.odd:VALUE", str(project))
    data_spec = legacy_data_spec(2, CARDS, K, N_CLASSES)
    with pytest.raises(ModelContractError, match="returned a int, not a torch.nn.Module"):
        model_from_spec(model_spec_for(ModelConfig(entrypoint="models.odd:not_a_module", code_dir=str(project)),
                                       data_spec))  # fmt: skip
    with pytest.raises(ModelContractError, match=r"must accept the data spec first, then model.params"):
        model_from_spec(model_spec_for(ModelConfig(entrypoint="models.odd:no_spec", code_dir=str(project)),
                                       data_spec))  # fmt: skip
    # a forward that needs more than (cont, cat): said when the model is built, not as a bare TypeError at a step
    write_module(
        project,
        "masked",
        """
        from models.world import WindowGRU

        class NeedsMask(WindowGRU):
            def forward(self, cont, cat, mask):
                return super().forward(cont, cat)
        """,
    )
    needs = ModelConfig(entrypoint="models.masked:NeedsMask", code_dir=str(project))
    with pytest.raises(ModelContractError, match=r"NeedsMask.forward\(cont, cat, mask\) cannot be called as forward"):
        model_from_spec(model_spec_for(needs, data_spec))
    # a misspelt param: the one it takes that is closest, said
    typo = ModelConfig(entrypoint="models.world:WindowGRU", code_dir=str(project), params={"hiddn": 8})
    with pytest.raises(ModelContractError, match=r"'hiddn'; did you mean model.params.hidden \(for hiddn\)\?"):
        model_from_spec(model_spec_for(typo, data_spec))
    # a call that fits, and a TypeError inside it (YAML reads 1e-1 as text): where, and the text, not the call
    with pytest.raises(ModelContractError, match=r"raised TypeError at .*odd.py:8: .*; model.params.dropout is the "
                       r"text '1e-1' \(YAML reads"):  # fmt: skip
        model_from_spec(model_spec_for(ModelConfig(entrypoint="models.odd:checks", code_dir=str(project),
                                                   params={"dropout": "1e-1"}), data_spec))  # fmt: skip


def test_an_import_error_inside_the_users_module_names_its_file_and_line(tmp_path):
    folder = tmp_path / "broken-proj"
    (folder / "brokenpkg").mkdir(parents=True)
    (folder / "brokenpkg" / "__init__.py").write_text("")
    (folder / "brokenpkg" / "net.py").write_text("import torch\n\nSCALE = 1 / 0\n")
    with pytest.raises(ModelContractError, match=r"importing brokenpkg.net failed \(.*net.py:3\): ZeroDivisionError"):
        import_entrypoint("brokenpkg.net:Net", str(folder))
    (folder / "brokenpkg" / "other.py").write_text("import not_a_real_package_xyz\n")
    with pytest.raises(ModelContractError, match=r"brokenpkg.other failed \(.*other.py:1\): .*_xyz.*install that"):
        import_entrypoint("brokenpkg.other:Net", str(folder))
    # a module of the user's own package that is not there: no package to install (it said "install that package")
    (folder / "brokenpkg" / "uses.py").write_text("import torch\nfrom brokenpkg.helpers import Thing\n")
    with pytest.raises(ModelContractError, match=r"failed \(.*uses.py:2\): .*'brokenpkg.helpers'; no such file in "
                       r"your package .*brokenpkg: add it or fix the import"):  # fmt: skip
        import_entrypoint("brokenpkg.uses:Net", str(folder))


def test_the_documented_example_model_trains_as_written(data, tmp_path):  # noqa: F811
    """docs/model-contract.md is the spec: its complete model, copied from the page, trains and predicts."""
    import re
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "model-contract.md").read_text()
    (source,) = re.findall(r"## A complete model, from this page alone\n\n```python\n(.*?)```", page, re.S)
    folder = tmp_path / "doc-repo"
    folder.mkdir()
    (folder / "docmodel.py").write_text(source)
    try:
        spec = model_spec_for(
            ModelConfig(entrypoint="docmodel:WindowGRU", params={"hidden": 8}, code_dir=str(folder)),
            legacy_data_spec(2, CARDS, K, N_CLASSES),
        )
        result = fit(
            data["classification"],
            data["classification-val"],
            spec,
            train_cfg(),
            "classification",
            str(tmp_path / "ckpt"),
            callbacks=Callbacks(log=quiet),
        )
        assert predict(load_model(result.best_checkpoint), data["classification-val"])["target"].shape[1] == N_CLASSES
    finally:
        sys.modules.pop("docmodel", None)


def test_fine_tuning_starts_from_matching_tensors_and_leaves_frozen_ones_bit_for_bit(data, project, tmp_path):  # noqa: F811
    from shardline.trainer.checkpoint import load_checkpoint

    base = fit(
        data["classification"],
        data["classification-val"],
        user_spec(project),
        train_cfg(),
        "classification",
        str(tmp_path / "base"),
        callbacks=Callbacks(log=quiet),
    )
    parent = load_checkpoint(base.best_checkpoint)["model"]
    # a head for one more class: its tensors do not fit and are skipped; the backbone is loaded and frozen
    wider = model_spec_for(
        ModelConfig(entrypoint="models.world:WindowGRU", params={"hidden": 16}, code_dir=str(project)),
        legacy_data_spec(2, CARDS, K, N_CLASSES + 1),
    )
    lines: list[str] = []
    tuned = fit(
        data["classification"],
        data["classification-val"],
        wider,
        train_cfg(freeze=["embed.", "gru."]),
        "classification",
        str(tmp_path / "tuned"),
        callbacks=Callbacks(log=lines.append),
        options=FitOptions(init_weights=parent, init_source="models:/base@champion"),
    )
    child = load_checkpoint(tuned.best_checkpoint)["model"]
    backbone = [k for k in parent if k.startswith(("embed.", "gru."))]
    assert backbone and all(torch.equal(child[k], parent[k]) for k in backbone)  # frozen: not one bit moved
    assert not torch.equal(child["heads.target.weight"][:N_CLASSES], parent["heads.target.weight"])
    init = tuned.run_meta["init_from"]
    assert init["source"] == "models:/base@champion" and set(backbone) <= set(init["loaded"])
    assert init["skipped"] == [
        f"heads.target.bias [{N_CLASSES}] -> [{N_CLASSES + 1}]",
        f"heads.target.weight [{N_CLASSES}, 16] -> [{N_CLASSES + 1}, 16]",
    ]
    # tensors of another shape start at random: a warning (the run's log takes it at its warning level), not a count
    (said,) = [line for line in lines if "init_from models:/base@champion: loaded" in line]
    assert said.startswith("warning: ") and said.endswith("another shape than the parent's and start at random")
    # the start line counts what trains, not only what the model holds
    heads = sum(child[k].numel() for k in child if k.startswith("heads."))
    total = sum(v.numel() for k, v in child.items() if not k.endswith(("running_mean", "running_var", "batches")))
    assert any(f"({total:,} parameters, {heads:,} of them trained)" in line for line in lines), lines[:3]


def test_a_frozen_backbones_batchnorm_keeps_its_running_statistics(data, project, tmp_path):  # noqa: F811
    write_module(
        project,
        "normed",
        """
        from torch import nn
        from models.world import WindowGRU

        class Normed(WindowGRU):
            def __init__(self, spec, hidden=16):
                super().__init__(spec, hidden=hidden)
                self.norm = nn.BatchNorm1d(spec.n_cont)

            def forward(self, cont, cat):
                return super().forward(self.norm(cont.float().transpose(1, 2)).transpose(1, 2), cat)
        """,
    )
    spec = user_spec(project, "models.normed:Normed")
    base = fit(
        data["classification"],
        data["classification-val"],
        spec,
        train_cfg(max_steps_per_epoch=4),
        "classification",
        str(tmp_path / "base"),
        callbacks=Callbacks(log=quiet),
    )
    from shardline.trainer.checkpoint import load_checkpoint

    parent = load_checkpoint(base.best_checkpoint)["model"]
    assert parent["norm.num_batches_tracked"].item() == 4  # the base run's norm learned its statistics
    lines: list[str] = []
    tuned = fit(
        data["classification"],
        data["classification-val"],
        spec,
        train_cfg(max_steps_per_epoch=4, freeze=["norm.", "embed.", "gru."]),
        "classification",
        str(tmp_path / "tuned"),
        callbacks=Callbacks(log=lines.append),
        options=FitOptions(init_weights=parent, init_source="parent"),
    )
    child = load_checkpoint(tuned.best_checkpoint)["model"]
    for key in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "norm.weight", "gru.weight_hh_l0"):
        assert torch.equal(child[key], parent[key]), key  # frozen: its statistics are the parent's, too
    assert not torch.equal(child["heads.target.weight"], parent["heads.target.weight"])  # the head trained
    assert any("1 norm layer(s) kept in eval mode" in line for line in lines)


def test_fine_tuning_refuses_unmatched_prefixes_and_weights_that_fit_nothing(data, project, tmp_path):  # noqa: F811
    with pytest.raises(ModelContractError, match=r"training.freeze: \['backbone.'\] match\(es\) no parameter"):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project),
            train_cfg(freeze=["backbone."]),
            "classification",
            str(tmp_path / "a"),
            callbacks=Callbacks(log=quiet),
        )
    with pytest.raises(ModelContractError, match=r"init_from=other: none of its 1 tensors matches WindowGRU"):
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project),
            train_cfg(),
            "classification",
            str(tmp_path / "b"),
            callbacks=Callbacks(log=quiet),
            options=FitOptions(init_weights={"x.weight": torch.zeros(2)}, init_source="other"),
        )
    # a frozen tensor the parent did not give (here: of another shape) would stay at its random start
    parent = model_from_spec(user_spec(project)).state_dict()
    parent["gru.weight_hh_l0"] = torch.zeros(48, 15)
    with pytest.raises(ModelContractError, match=r"freezes 1 tensor\(s\) that init_from parent did not load .*: "
                       r"gru.weight_hh_l0; they would stay at their random start"):  # fmt: skip
        fit(
            data["classification"],
            data["classification-val"],
            user_spec(project),
            train_cfg(freeze=["embed.", "gru."]),
            "classification",
            str(tmp_path / "c"),
            callbacks=Callbacks(log=quiet),
            options=FitOptions(init_weights=parent, init_source="parent"),
        )
    # a model that freezes a part of itself for the parent to fill: what the parent did not fill is said, not an
    # error (a frozen random layer may be meant), and trains no more than it would have
    write_module(
        project,
        "selffrozen",
        """
        from models.world import WindowGRU

        class SelfFrozen(WindowGRU):
            def __init__(self, spec, **params):
                super().__init__(spec, **params)
                self.gru.requires_grad_(False)
        """,
    )
    lines: list[str] = []
    fit(
        data["classification"],
        data["classification-val"],
        user_spec(project, "models.selffrozen:SelfFrozen"),
        train_cfg(max_steps_per_epoch=2),
        "classification",
        str(tmp_path / "d"),
        callbacks=Callbacks(log=lines.append),
        options=FitOptions(init_weights=parent, init_source="parent"),
    )
    said = [line for line in lines if line.startswith("warning: SelfFrozen freezes")]
    assert said and "1 parameter tensor(s) itself that init_from parent did not load" in said[0], lines
    assert "gru.weight_hh_l0; they stay at their random start" in said[0]


def test_two_projects_with_a_models_package_each_train_their_own_in_one_process(tmp_path):
    """A sweep, a worker or a notebook may train two projects in one process: each config's `models` is
    imported from its own code_dir, not the one imported first."""
    import sys

    first, second = tmp_path / "first", tmp_path / "second"
    write_module(first, "world", "class FirstNet:\n    pass\n")
    write_module(second, "vision", "class SecondNet:\n    pass\n")
    try:
        assert import_entrypoint("models.world:FirstNet", str(first)).__name__ == "FirstNet"
        assert import_entrypoint("models.vision:SecondNet", str(second)).__name__ == "SecondNet"
        assert import_entrypoint("models.world:FirstNet", str(first)).__name__ == "FirstNet"
    finally:
        for name in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
            del sys.modules[name]
        for folder in (first, second):
            if str(folder) in sys.path:
                sys.path.remove(str(folder))


def test_a_transformer_fine_tune_of_another_window_is_refused_not_re_initialised():
    """The transformer family's learned positions (one row per frame): a parent of another data.window would
    have them re-initialised (under a frozen backbone, silently); refused naming the setting, as the gpt's."""
    from shardline.trainer.contract import load_matching

    def transformer(window: int):
        cfg = {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2, "dropout": 0.0}
        return model_from_spec(model_spec_for(cfg, legacy_data_spec(2, CARDS, window, N_CLASSES)))

    child = transformer(K)
    with pytest.raises(ModelContractError, match=rf"\(position.weight\) cover a context of {K + 4} .*data.window"):
        load_matching(child, transformer(K + 4).state_dict(), "models:/world/3")
    assert "position.weight" in load_matching(child, transformer(K).state_dict(), "models:/world/3")["loaded"]


def test_a_loss_that_turns_nan_after_updates_names_the_learning_rate_the_model_uses():
    """A loss gone NaN at step 101 of a model that sets its own optimizer's rates said "lower training.lr", which that
    model does not read: it names the rate where it is set, and the model's outputs as the other cause."""
    import torch
    from torch import nn

    from shardline.trainer.contract import check_loss

    class Plain(nn.Linear):
        pass

    class OwnRates(nn.Linear):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    nan = torch.tensor(float("nan"))
    with pytest.raises(ModelContractError, match=r"at step 101: .*Lower training.lr, clip gradients .*forward"):
        check_loss(nan, 101, Plain(2, 2))
    with pytest.raises(ModelContractError, match=r"Lower the learning rate its configure_optimizers sets"):
        check_loss(nan, 101, OwnRates(2, 2))
