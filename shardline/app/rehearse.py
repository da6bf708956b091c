"""`shardline rehearse CONFIG`: the first full loop, on tiny data, where the real run will go.

Before paying for the full run, run everything once on a few of the user's own raw files: copy them
under `<storage.root>/rehearsals/<stamp>/raw/` (so storage is written and read for real), encode,
train one short epoch on the configured pool (a deployment, or in-process), take checkpoints, force a
preemption (the training process sends itself SIGTERM, the notice a spot instance gets) and resume
from the checkpoint in storage, evaluate, register `<model_name>-rehearsal` in the configured MLflow
registry, download the registered model again and predict raw rows with it. Each stage is one row of
a pass/fail table. Nothing of the real run (its shards, checkpoints, cache or registered model) is
touched: the rehearsal has its own storage prefix, experiment and model name.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

from shardline.core import storage
from shardline.core.config import PipelineConfig, validate_config

PREEMPT_ENV = "SHARDLINE_PREEMPT_AT_STEP"  # read by shardline.trainer.loop.fit


@dataclass
class Row:
    stage: str
    ok: bool
    detail: str


def rehearsal_config(config: PipelineConfig, root: str, steps: int, preempt_at: int, job_env: dict) -> PipelineConfig:
    raw = config.model_dump(mode="json")
    raw["name"] = f"{config.name}-rehearsal"
    raw["data"]["source"] = storage.join(root, "raw", "*.parquet")
    raw["storage"]["root"] = root
    raw["mlflow"]["experiment"] = f"{config.mlflow.experiment}-rehearsal"
    raw["mlflow"]["model_name"] = f"{config.mlflow.model_name}-rehearsal"
    raw["training"].update(
        epochs=1,
        max_steps_per_epoch=steps,
        checkpoint_every_steps=max(1, steps // 4),
        checkpoint_every_seconds=0,
        max_restarts=0,
    )
    raw["compute"]["max_preemptions"] = max(1, config.compute.max_preemptions)
    if config.compute.train_on == "deployment":
        jv = dict(raw["compute"].get("job_variables") or {})
        jv["env"] = {**job_env, **(jv.get("env") or {}), PREEMPT_ENV: str(preempt_at)}
        raw["compute"]["job_variables"] = jv
    return validate_config(raw, "the rehearsal config")


def deployment_env(name: str) -> dict:
    """The env job variable of a deployment (so that the rehearsal's own env adds to it, not replaces it)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(name)
    return dict((dep.job_variables or {}).get("env") or {})


def copy_sample(config: PipelineConfig, root: str, n_files: int) -> list[str]:
    from shardline.tasks.ingest import list_source

    files = list_source(config.data.source)
    if not files:
        raise FileNotFoundError(f"data.source={config.data.source} matches no parquet file")
    copied = []
    for uri in files[:n_files]:
        dest = storage.join(root, "raw", uri.rstrip("/").rsplit("/", 1)[-1])
        storage.write_bytes(dest, storage.read_bytes(uri))
        copied.append(dest)
    return copied


def rehearse(
    config: PipelineConfig, files: int = 8, steps: int = 20, preempt_at: int | None = None, log=print
) -> list[Row]:
    """Run the rehearsal; return its rows (every stage after a failed one is reported as not reached)."""
    from shardline.flows.pipeline import pipeline

    preempt_at = preempt_at or max(2, steps // 2)
    if preempt_at >= steps:
        raise ValueError(f"--preempt-at {preempt_at} must be below --steps {steps}, so that training resumes after it")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = storage.join(config.storage.root, "rehearsals", stamp)
    remote = config.compute.train_on == "deployment"
    rows: list[Row] = []

    def stage(name: str, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - reported as a failed row with its message
            ok, detail = False, f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
        rows.append(Row(name, ok, detail))
        return ok

    copied: list[str] = []

    def _copy():
        copied.extend(copy_sample(config, root, files))
        return True, f"{len(copied)} raw file(s) written to and read from {storage.join(root, 'raw')}"

    if not stage("storage: copy a sample of the raw data", _copy):
        return rows

    job_env = deployment_env(config.compute.train_deployment) if remote else {}
    cfg = rehearsal_config(config, root, steps, preempt_at, job_env)
    result: dict = {}
    attempts: list[str] = []

    def _pipeline():
        previous = os.environ.get(PREEMPT_ENV)
        if not remote:
            os.environ[PREEMPT_ENV] = str(preempt_at)
        try:
            for attempt in (1, 2):
                try:
                    result.update(pipeline(cfg))
                    break
                except Exception as e:  # in-process training: the preempted run fails the pipeline; run it again
                    if remote or attempt == 2 or "Preempted" not in f"{type(e).__name__}: {e}":
                        raise
                    attempts.append(f"attempt {attempt}: {type(e).__name__}")
        finally:
            if previous is None:
                os.environ.pop(PREEMPT_ENV, None)
            else:
                os.environ[PREEMPT_ENV] = previous
        return True, f"steps: {', '.join(f'{k} {v}' for k, v in result['steps'].items())}"

    if not stage("pipeline: ingest, encode, train, evaluate, register", _pipeline):
        return rows

    tr = result["train"]
    stage(
        "ingest: schema checked from the files' footers",
        lambda: (
            result["snapshot"]["files"] == len(copied),
            f"{result['snapshot']['files']} file(s), {len(result['snapshot']['skipped'])} skipped",
        ),
    )

    def _encode():
        from shardline.core.manifest import Manifest

        m = Manifest.model_validate_json(storage.read_text(result["manifest"]))
        return all(
            m.windows.get(s) for s in ("train", "validation", "test")
        ), f"{len(m.shards)} shard(s), windows {m.windows}"

    stage("encode: shards and manifest in storage", _encode)

    def _where():
        if not remote:
            return True, f"in-process on {tr['device']} ({tr['precision']})"
        runs = tr.get("flow_runs") or []
        return bool(runs) and runs[-1]["state"] == "Completed", (
            f"{config.compute.train_deployment} on host {tr.get('host')}, {tr['device']} ({tr['precision']}); flow "
            "runs: " + ", ".join(f"{r['name']} {r['state']}" for r in runs)
        )

    stage("train: one short epoch on the configured pool", _where)

    def _checkpoint():
        from shardline.trainer.checkpoint import latest_checkpoint

        found = latest_checkpoint(storage.join(tr["run_dir"], "checkpoints"))
        return found is not None and found[1]["step"] == tr["steps"], f"{found[0] if found else 'none'}"

    stage("checkpoint: written to storage, verified by checksum", _checkpoint)

    def _preempted():
        if remote:
            runs = tr.get("flow_runs") or []
            first = runs[0] if runs else {}
            ok = len(runs) >= 2 and first.get("state") != "Completed" and bool(tr.get("resumed_from"))
            return (
                ok,
                f"run {first.get('name')} ended {first.get('state')} at step {preempt_at}; re-dispatched, resumed "
                f"from {tr.get('resumed_from')}",
            )
        return bool(attempts) and bool(
            tr.get("resumed_from")
        ), f"{'; '.join(attempts) or 'not preempted'}; resumed from {tr.get('resumed_from')}"

    stage(f"preemption: SIGTERM at step {preempt_at}, then resume", _preempted)

    def _metrics():
        from mlflow import MlflowClient

        reg = result["registered"]
        run = MlflowClient(reg["tracking_uri"]).get_run(reg["run_id"])
        test = {k: round(v, 4) for k, v in run.data.metrics.items() if k.startswith("test/")}
        return run.info.status == "FINISHED" and bool(test), f"MLflow run {reg['run_id']} {run.info.status}: {test}"

    stage("metrics: logged to MLflow, run finished", _metrics)
    reg = result["registered"]
    stage(
        "register: model version in the registry",
        lambda: (bool(reg.get("version")), f"{reg['model_name']} version {reg['version']} @{reg['alias']}"),
    )

    def _download():
        import mlflow
        import polars as pl

        from shardline.core.tracking import fluent_tracking_uri

        sample = pl.read_parquet(storage.read_bytes(copied[0]))
        with fluent_tracking_uri(reg["tracking_uri"]):
            model = mlflow.pyfunc.load_model(reg["model_uri"])
        preds = model.predict(sample.drop([t.column for t in config.data.target_list]).to_pandas())
        return len(
            preds
        ) > 0, f"{reg['model_uri']} downloaded; {len(preds)} prediction(s) for {sample.height} raw row(s)"

    stage("download: the registered model predicts raw rows", _download)
    return rows
