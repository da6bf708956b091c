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
from collections import deque

from shardline.app.doctor_checks import Check
from shardline.core import layout, storage
from shardline.core.config import PipelineConfig, validate_config

PREEMPT_ENV = "SHARDLINE_PREEMPT_AT_STEP"  # read by shardline.trainer.stops.setting_hooks


def rehearsal_config(
    config: PipelineConfig, root: str, steps: int, preempt_at: int, job_env: dict, batch_size: int | None = None
) -> PipelineConfig:
    from shardline.core.secrets import KEEP_SECRETS

    raw = config.model_dump(mode="json", context=KEEP_SECRETS)  # a config for this process to run
    raw["name"] = f"{config.name}-rehearsal"
    raw["data"]["source"] = storage.join(root, "raw")  # the copies keep their paths below the source's folder
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
    if batch_size:
        raw["training"]["batch_size"] = batch_size
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


SAMPLE_FILE_BYTES = 32 << 20  # a raw file larger than this is copied in part: its first rows, about this much


def spread(total: int) -> list[int]:
    """0..total-1 in an order whose every prefix is spread over the whole range (the last, the first, the middle,
    the quarters...): the first few of a source's files sorted by time cover its whole span, so a range split
    (`data.split.method: range`, days in folders) finds rows for each of its splits; the first is the newest."""
    order = list(dict.fromkeys([total - 1, 0])) if total > 0 else []
    intervals = deque([(0, total - 1)])
    while intervals:
        lo, hi = intervals.popleft()
        if hi - lo >= 2:
            order.append((lo + hi) // 2)
            intervals.extend([(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)])
    return order


def copy_sample(config: PipelineConfig, root: str, n_files: int, skip: int = 0) -> list[str]:
    """Copy the source's files `skip` to `n_files` (in `spread`'s order) under `<root>/raw/`, each at its path below
    the source's folder (files of the same name in two folders, and hive-style folders' columns, kept); of a file
    larger than `SAMPLE_FILE_BYTES` (a click log in one file), its first rows only: the rehearsal's data stays tiny."""
    from shardline.core.encoding.read import sequence_name
    from shardline.core.listing import list_source

    files = list_source(config.data.source)
    if not files:
        raise FileNotFoundError(f"data.source={config.data.source} matches no parquet file")
    copied = []
    for uri in [files[i] for i in spread(len(files))[skip:n_files]]:
        dest = storage.join(root, "raw", sequence_name(uri, config.data))
        size = storage.size_of(uri) or 0
        storage.write_bytes(dest, storage.read_bytes(uri) if size <= SAMPLE_FILE_BYTES else _first_rows(uri))
        copied.append(dest)
    return copied


def _first_rows(uri: str) -> bytes:
    """A parquet file of `uri`'s first rows, about `SAMPLE_FILE_BYTES` of them in memory, with its schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = storage.filesystem(uri)
    batches, held = [], 0
    with fs.open(path, "rb") as f:
        source = pq.ParquetFile(f)
        for batch in source.iter_batches(batch_size=4096):
            batches.append(batch)
            held += batch.nbytes
            if held >= SAMPLE_FILE_BYTES:
                break
        out = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_batches(batches, schema=source.schema_arrow), out, compression="zstd")
    return out.getvalue().to_pybytes()


def steps_per_epoch(train_windows: int, batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one epoch (the training loop's own count: a last short batch counts)."""
    batches = -(-train_windows // batch_size)
    return -(-batches // grad_accum)


def size_batch(train_windows: int, batch_size: int, grad_accum: int, steps: int, multiple: int = 1) -> int | None:
    """The largest batch size (at most the configured one, a multiple of `multiple`: the training processes'
    count) that gives `steps` steps in one epoch of `train_windows` windows; None when even the smallest
    does not."""
    top = min(batch_size, max(train_windows, multiple))
    for b in range(top - top % multiple, 0, -multiple):
        if steps_per_epoch(train_windows, b, grad_accum) >= steps:
            return b
    return None


def rehearse(config: PipelineConfig, files: int, steps: int, preempt_at: int | None, log) -> list[Check]:
    """Run the rehearsal; return its rows (every stage after a failed one is reported as not reached)."""
    from shardline.core.listing import list_source
    from shardline.flows.pipeline import pipeline

    preempt_at = preempt_at or max(2, steps // 2)  # `shardline rehearse` checked a given one is below steps
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = layout.rehearsal(config.storage.root, stamp)
    remote = config.compute.train_on == "deployment"
    rows: list[Check] = []

    def stage(name: str, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - reported as a failed row with its message
            ok, detail = False, f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
        rows.append(Check(name, ok, detail))
        return ok

    copied: list[str] = []

    def _copy():
        copied.extend(copy_sample(config, root, files))
        return True, f"{len(copied)} raw file(s) written to and read from {storage.join(root, 'raw')}"

    if not stage("storage: copy a sample of the raw data", _copy):
        return rows

    job_env = deployment_env(config.compute.train_deployment) if remote else {}
    cfg = rehearsal_config(config, root, steps, preempt_at, job_env)
    available = len(list_source(config.data.source))

    def _size():
        # the forced preemption must happen: the sample must give more steps than `preempt_at`. Encode it (the
        # pipeline then finds it cached), then shrink the batch, copy more files, or, with all of them, shorten
        nonlocal cfg, steps, preempt_at
        from shardline.app.cost import encoded_data
        from shardline.core.encoding.columns import DataError
        from shardline.core.manifest import Manifest

        t = config.training
        world = config.compute.nodes * config.compute.processes_per_node  # each takes an equal share of a batch
        while True:
            try:
                windows = Manifest.model_validate_json(storage.read_text(encoded_data(cfg))).windows.get("train", 0)
            except DataError as e:  # a split the sample gives no row yet (a range of days): copy more files
                if not str(e).startswith("the split leaves") or len(copied) >= available:
                    raise
                windows = None
            batch = size_batch(windows, t.batch_size, t.grad_accum, steps, world) if windows is not None else None
            if batch is not None or len(copied) >= available:
                break
            copied.extend(copy_sample(config, root, min(available, 2 * len(copied)), skip=len(copied)))
        if batch is None:
            most = steps_per_epoch(windows, world, t.grad_accum)
            if most < 3:
                return False, (
                    f"the {len(copied)} raw file(s) give {windows} training window(s), {most} step(s): too few to "
                    "train, preempt and resume; the rehearsal needs at least 3 steps (more rows per file, or a "
                    "smaller data.window)"
                )
            steps, preempt_at, batch = most, max(1, most // 2) if preempt_at >= most else preempt_at, world
        cfg = rehearsal_config(config, root, steps, preempt_at, job_env, batch_size=batch)
        resized = "" if batch == t.batch_size else f" (training.batch_size {t.batch_size} -> {batch} for the rehearsal)"
        return True, (
            f"{len(copied)} file(s), {windows:,} training windows: {steps} steps of {batch}{resized}, "
            f"preempted at step {preempt_at}"
        )

    if not stage("sample: sized so that the preemption happens", _size):
        return rows
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
        if found is None:
            return False, "none"
        c = config.compute
        world, trained = c.nodes * c.processes_per_node, found[1].get("world_size", 1)
        said = found[0]
        if world > 1:  # the processes the config asks for really trained together
            said += f" (world size {trained} of {c.nodes} node(s) x {c.processes_per_node} process(es))"
        return found[1]["step"] == tr["steps"] and trained == world, said

    stage("checkpoint: written to storage, verified by checksum", _checkpoint)

    def _preempted():
        import re

        # where training really stopped: the checkpoint it resumed from (taken on the SIGTERM)
        found = re.search(r"ckpt-(\d+)\.pt$", tr.get("resumed_from") or "")
        at = int(found.group(1)) if found else None
        where = f"at step {at}" if at is not None else "without a checkpoint to resume from"
        if remote:
            runs = tr.get("flow_runs") or []
            first = runs[0] if runs else {}
            ok = len(runs) >= 2 and first.get("state") != "Completed" and at == preempt_at
            return ok, (
                f"run {first.get('name')} ended {first.get('state')} {where}; "
                + (f"re-dispatched, resumed from {tr['resumed_from']}" if at is not None else "not resumed")
            )
        ok = bool(attempts) and at == preempt_at
        return ok, f"{'; '.join(attempts) or 'not preempted'}; " + (
            f"resumed from {tr['resumed_from']} ({where})" if at is not None else "not resumed"
        )

    stage(f"preemption: SIGTERM at step {preempt_at}, then resume", _preempted)

    def _metrics():
        from mlflow import MlflowClient

        from shardline.core.tracking.tracker import tracking_uri

        reg = result["registered"]
        run = MlflowClient(tracking_uri(cfg.mlflow, cfg.storage.root)).get_run(reg["run_id"])
        test = {k: round(v, 4) for k, v in run.data.metrics.items() if k.startswith("test/")}
        return run.info.status == "FINISHED" and bool(test), f"MLflow run {reg['run_id']} {run.info.status}: {test}"

    stage("metrics: logged to MLflow, run finished", _metrics)
    reg = result["registered"]
    stage(
        "register: model version in the registry",
        lambda: (bool(reg.get("version")), f"{reg['model_name']} version {reg['version']} @{reg['alias']}"),
    )

    def _download():
        import polars as pl

        from shardline.core.encoding.folders import folder_columns, with_columns
        from shardline.core.tracking.tracker import fluent_tracking_uri, tracking_uri
        from shardline.runs.model_files import load_checked
        from shardline.trainer.serving import kept_notes, naive_utc

        sample = pl.read_parquet(storage.read_bytes(copied[0]))
        with fluent_tracking_uri(tracking_uri(cfg.mlflow, cfg.storage.root)):
            model = load_checked(reg["model_uri"])  # only with the files it was registered with
        # the columns the model takes, as `shardline predict` sends them (a target may be an input too)
        schema = model.metadata.get_input_schema()
        if schema is not None:
            names = schema.input_names()  # hive-style folders' columns too, as the encode read them
            sample = with_columns(sample, folder_columns(copied[0], cfg.data.source, names, sample.columns))
            sample = sample.select([c for c in names if c in sample.columns])
        with kept_notes() as notes:  # a few files' training has not seen every category: said in the row
            preds = model.predict(naive_utc(sample.to_pandas()))
        said = f"{reg['model_uri']} downloaded; {len(preds)} prediction(s) for {sample.height} raw row(s)"
        if notes:
            more = f" (and {len(notes) - 1} note(s) more)" if len(notes) > 1 else ""
            said += f"; of the rehearsal's few files, predict notes: {notes[0]}{more}"
        return len(preds) > 0, said

    stage("download: the registered model predicts raw rows", _download)
    return rows
