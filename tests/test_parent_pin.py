"""A fine-tune's parent (`training.init_from`) is resolved once per run into a typed `Parent` handed to every step: an
alias moved to another version while the run goes on does not make two of its steps disagree (the encoding, the run's
folder, the starting weights)."""

from __future__ import annotations

from shardline.core.config import validate_config
from shardline.runs.parent import pinned, resolve_parent
from shardline.runs.result import Parent
from shardline.runs.training_run import training_identity
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

    parent = resolve_parent(config)
    assert parent == Parent(uri="models:/base/1", name="base", version="1", run_id=parent.run_id) and parent.run_id
    pinned_config = pinned(config, parent)
    assert pinned_config.training.init_from == "models:/base/1"
    identity = training_identity(config, parent)
    assert identity["init_from"] == {"uri": "models:/base/1", "name": "base", "version": "1", "run_id": parent.run_id}

    client.set_registered_model_alias("base", "champion", "2")  # moved while the run goes on
    assert resolve_parent(config).version == "2"  # what a step resolving the alias again would get
    # a step handed the parent keys on it, not on where the alias points now; one handed only the pinned config
    # resolves the same version
    assert training_identity(config, parent) == identity == training_identity(pinned_config)
    assert resolve_parent(pinned_config) == parent
    assert pinned(pinned_config, parent) is pinned_config  # already pinned: as it is
    assert Parent.model_validate_json(parent.model_dump_json()) == parent  # as a flow run's parameter, and back
    unset = validate_config({**cfg, "training": {**cfg["training"], "init_from": None}})
    assert resolve_parent(unset) is None and pinned(unset, None) is unset
