"""What a user finds in the two UIs after a pipeline run, read back from the Prefect API and the MLflow store:
the runs name each other, the MLflow run has its data sets, system metrics and descriptions."""

import asyncio
import json

import pytest
from mlflow import MlflowClient

from shardline.core.config import validate_config
from shardline.core.manifest import Manifest
from tests.conftest import make_raw, tiny_config

pytestmark = pytest.mark.e2e


def read_flow_run(flow_run_id: str):
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    return asyncio.run(read())


def test_prefect_and_mlflow_runs_name_each_other_and_mlflow_shows_data_system_and_descriptions(
    tmp_path, prefect_api, monkeypatch
):
    from shardline.flows.pipeline import pipeline

    monkeypatch.setenv("SHARDLINE_SYSTEM_METRICS_SECONDS", "0.1")
    # a training of ~1 s (26 steps) however fast the machine: several samples, not a race with the sampler
    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0.04")
    make_raw(tmp_path / "raw", n_seq=12, rows=60)
    root = str(tmp_path / "store")
    result = pipeline(validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), root)))
    reg = result["registered"]
    client = MlflowClient(reg["tracking_uri"])
    run = client.get_run(reg["run_id"])
    tags = run.data.tags

    # MLflow -> Prefect: the training flow run and the pipeline's, by id (and UI address: a server is used)
    training = read_flow_run(tags["shardline.prefect.flow_run_id"])
    pipeline_run = read_flow_run(tags["shardline.prefect.pipeline_run_id"])
    assert training.name == tags["shardline.prefect.flow_run_name"] and training.name.startswith("tiny · train · ")
    assert tags["shardline.prefect.flow_run_url"].endswith(f"/runs/flow-run/{training.id}")
    assert tags["shardline.prefect.register.flow_run_id"] == str(pipeline_run.id)  # who logged the test metrics
    # Prefect -> MLflow: the runs are tagged with the MLflow run and the version they made, and the
    # pipeline's run is named after it (not a random "brave-cheetah")
    for flow_run in (training, pipeline_run):
        assert {"model:tiny-model", "model-version:tiny-model/1"} <= set(flow_run.tags), flow_run.tags
    assert f"mlflow-run:{reg['run_id']}" in training.tags and f"mlflow-run:{reg['run_id']}" in pipeline_run.tags
    assert pipeline_run.name == "tiny · tiny-model v1 champion"

    # the data set panel: one input per split, the manifest's, sized as the manifest says
    manifest = Manifest.model_validate_json(open(result["manifest"]).read())
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"train", "validation", "test"}
    for split, dataset in inputs.items():
        assert dataset.name == f"tiny-{split}" and dataset.source_type == "shardline-manifest"
        assert json.loads(dataset.profile)["windows"] == manifest.windows[split] > 0
        assert json.loads(dataset.source)["uri"] == result["manifest"]
        assert [c["name"] for c in json.loads(dataset.schema)["mlflow_colspec"]] == ["x", "y", "kind", "flag"]
    assert len({d.digest for d in inputs.values()}) == 3

    # the System metrics tab: the machine while it trained
    metrics = run.data.metrics
    assert metrics["system/process_memory_rss_megabytes"] > 50
    assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100 * 64
    assert len(client.get_metric_history(run.info.run_id, "system/system_memory_usage_megabytes")) >= 2

    # the descriptions: the version's, the registered model's, the run's
    version = client.get_model_version("tiny-model", "1")
    assert "accuracy" in version.description and "@champion" in version.description
    assert "baseline" in version.description and f"{result['metrics']['accuracy']:.4g}" in version.description
    assert "@champion moves only" in client.get_registered_model("tiny-model").description
    assert "Registered as [tiny-model v1](" in tags["mlflow.note.content"]
    assert "/#/models/tiny-model/versions/1" in tags["mlflow.note.content"]
