"""A fine-tune's parent (`training.init_from`) is resolved once per run: an alias moved to another version while the
run goes on does not make two of its steps disagree (the encoding, the run's folder, the starting weights)."""

from __future__ import annotations

from shardline.core.config import validate_config
from shardline.runs.training_run import parent_model, pin_parent, training_identity
from tests.conftest import tiny_config


def test_an_alias_moved_mid_run_leaves_the_run_on_the_version_it_started_from(tmp_path):
    from mlflow import MlflowClient

    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking)
    experiment = client.create_experiment("parents", artifact_location=(tmp_path / "artifacts").as_uri())
    client.create_registered_model("base")
    for _ in range(2):
        run = client.create_run(experiment)
        client.create_model_version("base", f"{run.info.artifact_uri}/model", run.info.run_id)
    client.set_registered_model_alias("base", "champion", "1")

    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"))
    cfg["mlflow"]["tracking_uri"] = tracking
    cfg["training"]["init_from"] = "models:/base@champion"
    config = validate_config(cfg)

    pinned = pin_parent(config)
    assert pinned.training.init_from == "models:/base/1"
    identity = training_identity(pinned)
    assert identity["init_from"]["version"] == "1"

    client.set_registered_model_alias("base", "champion", "2")  # moved while the run goes on
    assert parent_model(config)["version"] == "2"  # what a step resolving the alias again would get
    assert parent_model(pinned)["version"] == "1" and training_identity(pinned) == identity
    assert pin_parent(pinned) is pinned  # already pinned: as it is
    assert (
        pin_parent(validate_config({**cfg, "training": {**cfg["training"], "init_from": None}})).training.init_from
        is None
    )
