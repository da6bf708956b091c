from pathlib import Path

import pytest
import yaml

from shardline.core.config import ConfigError, load_config
from tests.conftest import tiny_config

DEMO = Path(__file__).resolve().parents[1] / "shardline" / "configs" / "demo.yaml"


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_valid_config_gets_defaults(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", tiny_config("raw/*.parquet", str(tmp_path / "store"))))
    assert cfg.mlflow.promotion_metric == "accuracy"
    assert cfg.mlflow.promotion_direction == "maximize"
    assert cfg.data.effective_horizon == 1
    # relative paths are relative to the config file, not to the working directory
    assert cfg.data.source == str(tmp_path / "raw" / "*.parquet")


def test_unknown_key_is_named(tmp_path):
    raw = tiny_config("raw", "store")
    raw["training"]["epochz"] = 3
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path / "c.yaml", raw))
    assert "unknown key 'training.epochz'" in str(e.value)


def test_bad_value_names_key_value_and_allowed(tmp_path):
    raw = tiny_config("raw", "store")
    raw["training"]["precision"] = "fp8"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path / "c.yaml", raw))
    msg = str(e.value)
    assert "training.precision" in msg and "'fp8'" in msg and "bf16" in msg


def test_window_without_sequence_is_refused(tmp_path):
    raw = tiny_config("raw", "store")
    raw["data"]["sequence_key"] = None
    with pytest.raises(ConfigError, match="data.window=3 needs data.sequence_key"):
        load_config(write(tmp_path / "c.yaml", raw))

    # rows without sequences: a horizon ahead of them crossed from one split's rows into another's
    raw["data"].update(window=1, horizon=1, order_by=None)
    with pytest.raises(ConfigError, match="data.horizon=1 predicts the target 1 row.*set data.sequence_key"):
        load_config(write(tmp_path / "c.yaml", raw))
    raw["data"]["horizon"] = None
    assert load_config(write(tmp_path / "c.yaml", raw)).data.effective_horizon == 0


def test_a_target_the_model_reads_in_its_own_row_is_refused(tmp_path):
    """A target that is also a feature, at horizon 0: the model trains on the answer in its input, scores
    perfectly, and predicts nothing a user wants. Rows ahead (the default with sequences) it is what they mean."""
    raw = tiny_config("raw", "store")
    raw["data"]["target"] = {"column": "x", "task": "regression"}
    assert load_config(write(tmp_path / "c.yaml", raw)).data.effective_horizon == 1  # the next row's x: fine
    raw["data"]["horizon"] = 0
    with pytest.raises(ConfigError, match=r"data.target \['x'\] is also in data.features, and data.horizon is 0"):
        load_config(write(tmp_path / "c.yaml", raw))


def test_split_fractions_must_sum_to_one(tmp_path):
    raw = tiny_config("raw", "store")
    raw["data"]["split"]["fractions"] = {"train": 0.9, "validation": 0.2, "test": 0.1}
    with pytest.raises(ConfigError, match="must sum to 1"):
        load_config(write(tmp_path / "c.yaml", raw))
    # every split the run needs, before any work (no validation split failed after the ingest and the encode)
    raw["data"]["split"]["fractions"] = {"train": 0.9, "test": 0.1}
    with pytest.raises(ConfigError, match="data.split.fractions.validation must be > 0: checkpoints are chosen"):
        load_config(write(tmp_path / "c.yaml", raw))
    raw["data"]["split"] = {"method": "range", "column": "season", "ranges": {"train": [0, 1], "test": [2, None]}}
    with pytest.raises(ConfigError, match="data.split.ranges.validation is required"):
        load_config(write(tmp_path / "c.yaml", raw))


def test_promotion_metric_must_fit_the_task(tmp_path):
    raw = tiny_config("raw", "store")
    raw["mlflow"]["promotion_metric"] = "rmse"
    with pytest.raises(ConfigError, match="'rmse' is not a metric of the targets \\['label'\\]"):
        load_config(write(tmp_path / "c.yaml", raw))


def _several(raw: dict) -> dict:
    raw["data"].pop("target")
    raw["data"]["targets"] = [{"column": "label", "task": "classification"}, {"column": "x", "task": "regression"}]
    return raw


def test_several_targets_name_their_metrics(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", _several(tiny_config("raw", "store"))))
    assert [t.column for t in cfg.data.target_list] == ["label", "x"]
    # the default promotion metric is the first target's, named with it
    assert (cfg.mlflow.promotion_metric, cfg.mlflow.promotion_direction) == ("label/accuracy", "maximize")
    cfg = load_config(tmp_path / "c.yaml", ["mlflow.promotion_metric=x/rmse", "training.loss_weights={x: 0.5}"])
    assert (cfg.mlflow.promotion_metric, cfg.mlflow.promotion_direction) == ("x/rmse", "minimize")
    assert "x" in cfg.data.raw_columns() and "label" in cfg.data.raw_columns()
    with pytest.raises(ConfigError, match="'accuracy' is not a metric of the targets"):
        load_config(tmp_path / "c.yaml", ["mlflow.promotion_metric=accuracy"])  # which target's?
    with pytest.raises(ConfigError, match="x/accuracy"):
        load_config(tmp_path / "c.yaml", ["mlflow.promotion_metric=x/accuracy"])  # x is a regression
    with pytest.raises(ConfigError, match=r"training.loss_weights names \['z'\].*\['label', 'x'\]"):
        load_config(tmp_path / "c.yaml", ["training.loss_weights={z: 1}"])
    with pytest.raises(ConfigError, match=r"training.loss_weights \{'x': -1.0\}: a weight must be a number >= 0"):
        load_config(tmp_path / "c.yaml", ["training.loss_weights={x: -1}"])  # it maximised that target's loss
    # one target: its name in the metric is optional
    one = load_config(
        write(tmp_path / "one.yaml", tiny_config("raw", "store")), ["mlflow.promotion_metric=label/log_loss"]
    )
    assert (one.mlflow.promotion_metric, one.mlflow.promotion_direction) == ("log_loss", "minimize")


def test_target_settings_that_cannot_work_are_refused(tmp_path):
    raw = _several(tiny_config("raw", "store"))
    raw["data"]["target"] = {"column": "label", "task": "classification"}
    with pytest.raises(ConfigError, match="set data.target .* or data.targets .*, not both"):
        load_config(write(tmp_path / "both.yaml", raw))
    raw = _several(tiny_config("raw", "store"))
    raw["data"]["targets"].append({"column": "x", "task": "regression"})
    with pytest.raises(ConfigError, match=r"data.targets lists \['x'\] more than once"):
        load_config(write(tmp_path / "twice.yaml", raw))
    raw = tiny_config("raw", "store")
    raw["data"].pop("target")
    with pytest.raises(ConfigError, match="required for the built-in model families"):
        load_config(write(tmp_path / "none.yaml", raw))
    # no target is fine for a model of one's own (its loss is checked when it is built)
    raw["model"] = {"entrypoint": "models.mine:Net"}
    cfg = load_config(write(tmp_path / "own.yaml", raw))
    assert cfg.data.target_list == [] and cfg.mlflow.promotion_metric == "loss"
    raw = tiny_config("raw", "store")
    raw["data"]["target_positions"] = "all"
    with pytest.raises(ConfigError, match="target_positions='all' needs a model that predicts every position"):
        load_config(write(tmp_path / "all.yaml", raw))
    assert (
        load_config(tmp_path / "all.yaml", ["model.family=transformer", "model.heads=4"]).data.target_positions == "all"
    )


def test_extends_and_set_overrides(tmp_path):
    write(tmp_path / "base.yaml", tiny_config("raw", "store"))
    write(tmp_path / "gpu.yaml", {"extends": "base.yaml", "training": {"batch_size": 1024, "precision": "bf16"}})
    cfg = load_config(tmp_path / "gpu.yaml", ["training.epochs=7", "model.family=transformer", "model.heads=4"])
    assert cfg.training.batch_size == 1024 and cfg.training.precision == "bf16"
    assert cfg.training.epochs == 7 and cfg.model.family == "transformer"
    assert cfg.training.lr == 0.01  # inherited from the base
    # the resolved config is what is hashed: an override changes the hash
    assert cfg.hash() != load_config(tmp_path / "gpu.yaml").hash()
    # an empty mapping clears an inherited one (it merged into it: a child could not take the parent's away)
    write(tmp_path / "weighted.yaml", {"extends": "base.yaml", "model": {"params": {"dropout": 0.2}}})
    write(tmp_path / "plain.yaml", {"extends": "weighted.yaml", "model": {"params": {}}, "training": {}})
    assert load_config(tmp_path / "weighted.yaml").model.params == {"dropout": 0.2}
    plain = load_config(tmp_path / "plain.yaml")
    assert plain.model.params == {} and plain.training.lr == 0.01  # a whole section written {} keeps the parent's


def test_an_entrypoint_given_by_set_finds_its_code_beside_the_config_file(tmp_path):
    """`--set model.entrypoint=...` (trying one's own model on a built-in config): model.code_dir defaults to the
    config file's folder, as for an entrypoint written in the file, not only the working directory."""
    project = tmp_path / "proj"
    (project / "mymodels").mkdir(parents=True)
    (project / "mymodels" / "__init__.py").write_text("")
    (project / "mymodels" / "tiny.py").write_text("class Tiny:\n    pass\n")
    write(project / "c.yaml", tiny_config("raw/*.parquet", "store"))
    cfg = load_config(project / "c.yaml", ["model.entrypoint=mymodels.tiny:Tiny"])
    assert cfg.model.code_dir == str(project)
    from tests.test_cli import shardline

    out = shardline("check-config", project / "c.yaml", "--set", "model.entrypoint=mymodels.tiny:Tiny", cwd=tmp_path)
    assert "no module 'mymodels'" not in out.stderr, out.stderr
    # where it is written, `--set model.code_dir` wins (relative to the working directory, as a shell path)
    assert load_config(project / "c.yaml", ["model.entrypoint=m:M", "model.code_dir=/elsewhere"]).model.code_dir == (
        "/elsewhere"
    )


def test_extends_loop_and_missing_file(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_bad_set_syntax(tmp_path):
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(write(tmp_path / "c.yaml", tiny_config("raw", "store")), ["training.epochs"])
    # a value that is not YAML: the --set named, as a config error (it was a bare ParserError)
    with pytest.raises(ConfigError, match=r"--set 'data.window=\[1': the value does not read as YAML"):
        load_config(tmp_path / "c.yaml", ["data.window=[1"])


def test_demo_config_declares_exactly_the_demo_columns():
    from shardline.app.cli import DEMO_CONFIG
    from shardline.app.demo_data import DEMO_BOOLEAN, DEMO_CATEGORICAL, DEMO_CONTINUOUS, DEMO_TARGET

    cfg = load_config(DEMO_CONFIG)
    assert cfg.data.features.continuous == DEMO_CONTINUOUS
    assert cfg.data.features.boolean == DEMO_BOOLEAN
    assert cfg.data.features.categorical == DEMO_CATEGORICAL
    assert cfg.data.target.column == DEMO_TARGET


def test_the_shipped_demo_config_s_paths_are_the_extending_config_s_not_the_installed_package_s(tmp_path, monkeypatch):
    """`extends:` the demo config inside the package (a complete example, its header says): its relative
    data.source and storage.root are read beside the config that extends it (they wrote the store into the
    installed package); the shipped config given itself, in the working directory."""
    from shardline.app.cli import DEMO_CONFIG

    (tmp_path / "proj").mkdir()
    mine = write(tmp_path / "proj" / "mine.yaml", {"extends": str(DEMO_CONFIG), "training": {"epochs": 1}})
    cfg = load_config(mine)
    assert cfg.storage.root == str(tmp_path / "proj" / "store")
    assert cfg.data.source == str(tmp_path / "proj" / "data" / "raw" / "*.parquet")
    monkeypatch.chdir(tmp_path)
    assert load_config(DEMO_CONFIG).storage.root == str(tmp_path / "store")


@pytest.mark.parametrize(
    "compute, said",
    [
        ({"dask_address": "tcp://h:8786"}, "compute.dask_address is set but compute.task_runner is 'threads'"),
        ({"task_runner": "dask", "dask_address": "h:8786"}, "write it as tcp://host:8786"),
        # a dashboard's address is no scheduler's: refused here (Dask took a minute to say it, then a traceback)
        ({"task_runner": "dask", "dask_address": "http://h:8787"}, "not a Dask scheduler's address"),
        ({"task_runner": "dask", "dask_address": "tcp://h:8786", "dask_workers": 2}, "remove compute.dask_workers"),
    ],
)
def test_dask_settings_that_cannot_work_are_named(tmp_path, compute, said):
    raw = tiny_config("raw", "store")
    raw["compute"] = compute
    with pytest.raises(ConfigError, match=said):
        load_config(write(tmp_path / "c.yaml", raw))
    raw["compute"] = {"task_runner": "dask", "dask_workers": 2}  # a local cluster of two processes
    assert load_config(write(tmp_path / "c.yaml", raw)).compute.dask_workers == 2


def test_a_config_given_inline_as_yaml_text_is_read_as_one_and_never_quoted(tmp_path, monkeypatch):
    """prefect.yaml's `config` parameter may be "the config inline": its YAML text (what a user pastes into
    `prefect deployment run ... -p config=...` or the UI) was taken for a file's path. The run failed with
    "config file not found: <the whole text>", its URL's password unmasked (the path collapsed `//`), and the flow
    run was named after the text. Now it is a config, `extends:` read from the working folder (a worker's: the
    project), and the run is named by its `name`; text that is no config is refused without quoting it."""
    from shardline.core.sweep import raw_config, read_space
    from shardline.flows.pipeline import resolve_config
    from shardline.runs.links import run_name_of

    base = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"))
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    monkeypatch.chdir(tmp_path)
    text = (
        "extends: base.yaml\nname: nightly\n"
        "mlflow: {tracking_uri: 'http://bob:TrackPw987@127.0.0.1:5902', model_name: nightly-model}\n"
    )
    config = resolve_config(text)
    assert (config.name, config.mlflow.model_name, config.data.window) == ("nightly", "nightly-model", 3)
    assert config.storage.root == str(tmp_path / "store")
    assert raw_config(text)["name"] == "nightly"  # a sweep's base config, the same way
    assert run_name_of(text) == "nightly" and run_name_of("configs/retrain.yaml") == "retrain"
    # a file's `name`, as the training runs it starts are named (a sweep's flow run was named after the file)
    (tmp_path / "team-sw.yaml").write_text(text)
    assert run_name_of(str(tmp_path / "team-sw.yaml")) == "nightly"
    assert read_space("training.lr: [0.01, 0.001]\n") == read_space_file(tmp_path, "training.lr: [0.01, 0.001]\n")
    for bad, said in [
        ("mlflow: {tracking_uri: 'http://bob:TrackPw987@h'\n  bad: [", "the config given inline is not valid YAML at"),
        ("- a: 1\n- b: 2\n", "the config given inline must be a mapping of sections"),
    ]:
        with pytest.raises(ConfigError, match=said) as e:
            resolve_config(bad)
        assert "TrackPw987" not in str(e.value) and "bad:" not in str(e.value)
        assert run_name_of(bad) == "shardline"
    # a file's: named, with where and what, never its line (it may hold a secret), nor yaml's "<unicode string>"
    (tmp_path / "broken.yaml").write_text("mlflow: {tracking_uri: 'http://bob:TrackPw987@h'\n  bad: [")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML at line 2, column \d+: ") as e:
        load_config(tmp_path / "broken.yaml")
    assert "TrackPw987" not in str(e.value) and "unicode string" not in str(e.value), str(e.value)


def read_space_file(folder, text: str):
    from shardline.core.sweep import read_space

    (folder / "space.yaml").write_text(text)
    return read_space(str(folder / "space.yaml"))


def test_a_built_in_familys_params_are_checked_and_another_model_does_not_inherit_its_parents(tmp_path):
    """`model.params.width` on the built-in mlp passed check-config and failed after the ingest and the encode with a
    bare TypeError; and a config extending another but naming its own model took the other model's params too
    (`unexpected keyword argument 'layers'`, from the parent file): a new model starts from its own params."""
    write(tmp_path / "base.yaml", tiny_config("raw", "store"))
    with pytest.raises(ConfigError, match=r"model.params \['hiden'\] are not settings of the built-in mlp family, "
                       r"which takes \['hidden', 'layers', 'dropout', 'embedding_dim'\]; did you mean "
                       r"model.params.hidden for hiden\?"):  # fmt: skip
        load_config(tmp_path / "base.yaml", ["model.params.hiden=1"])
    write(tmp_path / "pre.yaml", {"extends": "base.yaml", "model": {"entrypoint": "m:Pre", "params": {"layers": 2}}})
    write(tmp_path / "mine.yaml", {"extends": "pre.yaml", "model": {"entrypoint": "m:Mine", "params": {"hidden": 32}}})
    write(tmp_path / "more.yaml", {"extends": "pre.yaml", "model": {"params": {"hidden": 32}}})
    assert load_config(tmp_path / "mine.yaml").model.params == {"hidden": 32}  # its own model: its own params
    assert load_config(tmp_path / "more.yaml").model.params == {"layers": 2, "hidden": 32}  # the same model: merged


def test_a_tokenizer_given_its_vocabulary_size_alone_is_a_bpe(tmp_path):
    """`--set data.tokenizer.vocab_size=500` on a config without a tokenizer (a fine-tune that takes its parent's)
    was refused as neither a bpe nor a file: a vocabulary size is a BPE's. Neither, or both, is still refused."""
    from shardline.core.config.data import TokenizerConfig

    assert TokenizerConfig(vocab_size=500) == TokenizerConfig(kind="bpe", vocab_size=500)
    with pytest.raises(ValueError, match=r"either \{kind: bpe, vocab_size: N\}"):
        TokenizerConfig()
    with pytest.raises(ValueError, match="vocab_size is a bpe setting: a tokenizer file has its own vocabulary"):
        TokenizerConfig(vocab_size=500, file=str(tmp_path / "tokenizer.json"))


def test_a_yes_or_no_where_a_number_is_meant_is_refused_naming_the_key():
    """pydantic reads `true` as 1: `--grid model.hidden=true,16` trained a model of one hidden unit without a word.
    Refused now, in any section, naming the key; a number and a real yes/no setting are as before."""
    for override, said in (
        ("model.hidden=true", r"model: hidden: true is a yes or no, where a number is meant"),
        ("training.lr=false", r"training: lr: false is a yes or no, where a number is meant"),
    ):
        with pytest.raises(ConfigError, match=said):
            load_config(DEMO, [override])
    config = load_config(DEMO, ["model.hidden=16", "training.deterministic=true"])
    assert config.model.hidden == 16 and config.training.deterministic is True


def test_a_freeze_without_a_parent_is_refused(tmp_path):
    """`training.freeze` without `training.init_from` (the fine-tune example with its parent set to null) trained
    a frozen random backbone and registered it as champion. Refused before any work, saying what to set; with a
    parent it is a fine-tune."""
    raw = tiny_config("raw", "store")
    raw["training"]["freeze"] = ["backbone."]
    with pytest.raises(ConfigError, match=r"training.freeze \['backbone.'\] without training.init_from: .*random"):
        load_config(write(tmp_path / "c.yaml", raw))
    parent = load_config(tmp_path / "c.yaml", ["training.init_from=models:/pretrained@champion"])
    assert parent.training.freeze == ["backbone."]


def test_a_checkpoint_parent_is_found_beside_the_config_file_and_a_registered_one_is_left_as_it_is(tmp_path):
    """`training.init_from` a run's checkpoints by a relative path is relative to the config file, as data.source
    and storage.root are (it was the working folder's, and the version's parent tags named it so)."""
    raw = tiny_config("raw", "store")
    raw["training"]["init_from"] = "store/runs/abc/checkpoints"
    (tmp_path / "project").mkdir()
    cfg = load_config(write(tmp_path / "project" / "c.yaml", raw))
    assert cfg.training.init_from == str((tmp_path / "project" / "store/runs/abc/checkpoints").resolve())
    for parent in ("models:/pretrained@champion", "s3://bucket/runs/abc/checkpoints"):
        given = load_config(tmp_path / "project" / "c.yaml", [f"training.init_from={parent}"])
        assert given.training.init_from == parent
