import pytest
import yaml

from shardline.core.config import ConfigError, load_config
from tests.conftest import tiny_config


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


def test_split_fractions_must_sum_to_one(tmp_path):
    raw = tiny_config("raw", "store")
    raw["data"]["split"]["fractions"] = {"train": 0.9, "validation": 0.2, "test": 0.1}
    with pytest.raises(ConfigError, match="must sum to 1"):
        load_config(write(tmp_path / "c.yaml", raw))


def test_promotion_metric_must_fit_the_task(tmp_path):
    raw = tiny_config("raw", "store")
    raw["mlflow"]["promotion_metric"] = "rmse"
    with pytest.raises(ConfigError, match="not a classification metric"):
        load_config(write(tmp_path / "c.yaml", raw))


def test_extends_and_set_overrides(tmp_path):
    write(tmp_path / "base.yaml", tiny_config("raw", "store"))
    write(tmp_path / "gpu.yaml", {"extends": "base.yaml", "training": {"batch_size": 1024, "precision": "bf16"}})
    cfg = load_config(tmp_path / "gpu.yaml", ["training.epochs=7", "model.family=transformer", "model.heads=4"])
    assert cfg.training.batch_size == 1024 and cfg.training.precision == "bf16"
    assert cfg.training.epochs == 7 and cfg.model.family == "transformer"
    assert cfg.training.lr == 0.01  # inherited from the base
    # the resolved config is what is hashed: an override changes the hash
    assert cfg.hash() != load_config(tmp_path / "gpu.yaml").hash()


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


def test_demo_config_declares_exactly_the_demo_columns():
    from shardline.app.cli import DEMO_CONFIG
    from shardline.app.demo_data import DEMO_BOOLEAN, DEMO_CATEGORICAL, DEMO_CONTINUOUS, DEMO_TARGET

    cfg = load_config(DEMO_CONFIG)
    assert cfg.data.features.continuous == DEMO_CONTINUOUS
    assert cfg.data.features.boolean == DEMO_BOOLEAN
    assert cfg.data.features.categorical == DEMO_CATEGORICAL
    assert cfg.data.target.column == DEMO_TARGET
