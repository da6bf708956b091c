"""The whole pipeline: ingest -> encode -> train -> evaluate -> register. Thin: it only wires steps.

Every step is cached by the content of its inputs (shardline/tasks/caching.py): a rerun redoes only what
changed, and `force` refreshes one step and everything after it.
"""

from __future__ import annotations

from prefect import flow

from shardline.core import listing, storage
from shardline.core.config import ConfigError, PipelineConfig, load_config, validate_config
from shardline.core.config.load import inline_config, is_inline
from shardline.core.encoding.reuse import check_columns
from shardline.core.failures import retry_on_infrastructure
from shardline.core.memory import return_freed_memory, trim
from shardline.core.secrets import install_log_redaction, redacted_errors
from shardline.flows.runners import encode_runner
from shardline.flows.train import train
from shardline.runs import links
from shardline.runs.parent import check_window, parent_encoding, pinned, resolve_parent, with_parent_tokenizer
from shardline.runs.result import Parent
from shardline.tasks.caching import STEPS, cached, run_cached
from shardline.tasks.encode import encode, without_damaged
from shardline.tasks.evaluate import EVALUATE_CACHE, evaluate, no_better_than_baseline
from shardline.tasks.ingest import INGEST_CACHE, ingest
from shardline.tasks.register import REGISTER_CACHE, register, with_alias_now
from shardline.tasks.train import TRAIN_CACHE, train_step


def _refreshed(force: str | None) -> set[str]:
    if force is None:
        return set()
    if force not in STEPS:
        raise ValueError(f"force='{force}' is not a step; allowed: {list(STEPS)}")
    return set(STEPS[STEPS.index(force) :])


def resolve_config(config: PipelineConfig | dict | str) -> PipelineConfig:
    """A deployment's `config` parameter: a path to a YAML file (on the worker), or the config inline."""
    if isinstance(config, PipelineConfig):
        return config
    if isinstance(config, str) and not is_inline(config):
        return load_config(config)
    raw = inline_config(config) if isinstance(config, str) else config
    return validate_config(raw, "the 'config' parameter")


def baseline_name(config: PipelineConfig) -> str:
    """What the test table's baseline is: the majority class or the mean; ranking data, the items' popularity
    or chance."""
    if not config.data.group_key:
        return "the trivial baseline"
    return "the popularity baseline" if config.data.item_key else "a random order of each group"


def encoded_data(config: PipelineConfig, refresh: frozenset[str] = frozenset(), parent: Parent | None = None):
    """Ingest and encode, inside a flow run: (the snapshot, the manifest's URI, its checksum, which of the
    two steps ran rather than came from the cache). `refresh`: the steps `--force` recomputes; `parent`: the
    fine-tune parent the flow resolved (else resolved here from training.init_from)."""
    root = config.storage.root
    if missing := listing.no_bucket(root):  # before any write: a write there (Prefect's results) made the bucket
        raise ConfigError(f"storage.root {root}{missing}: create it (`aws s3 mb`) or fix storage.root; nothing was run")
    # fine-tuning: the data is encoded the way the model it starts from was trained (its scalings, vocabularies)
    parent = parent or resolve_parent(config)  # None without training.init_from
    base = (parent_encoding(config, parent), parent.uri) if parent else None
    data = config.data
    if base is not None:  # a column the parent was not trained on, another window of its positions: before any work
        check_columns(config.data.features.model_dump(), *base)
        check_window(config, *base)
        if base[0].text is not None:  # a text model's token ids mean words by its tokenizer: the parent's
            data = with_parent_tokenizer(config, parent, base[0])
    ran: dict[str, bool] = {}
    snapshot, ran["ingest"] = run_cached(ingest, INGEST_CACHE, root, "ingest" in refresh, config.data, root)
    manifest_uri, ran["encode"] = encode(  # on the flow's threads, or a Dask cluster (compute.task_runner)
        snapshot, data, root, refresh="encode" in refresh, base=base, runner=encode_runner(config)
    )
    snapshot = without_damaged(snapshot, manifest_uri, data)  # files the encode found damaged inside
    return snapshot, manifest_uri, storage.sha256_uri(manifest_uri), ran


@flow(name="pipeline", log_prints=True, flow_run_name=links.flow_run_name("pipeline"))
@redacted_errors
def pipeline(config: PipelineConfig | str, force: str | None = None) -> dict:
    """Raw parquet to a registered, evaluated model version. `config`: a YAML path or the config itself."""
    install_log_redaction()  # no secret in the console or the Prefect API's logs
    return_freed_memory()  # buffers of shards decompressed for a moment go back to the system when freed
    config = resolve_config(config)
    parent = resolve_parent(config)  # the fine-tune parent, resolved once and handed to every step
    config = pinned(config, parent)  # init_from names it, for a step that reads only the config
    root = config.storage.root
    refresh = _refreshed(force)
    snapshot, manifest_uri, manifest_hash, ran = encoded_data(config, refresh, parent)
    trim()  # what the encode freed goes back before training (pyarrow's allocator kept ~84 MB at 22,000 games)

    # retried after an infrastructure failure (I/O, network, CUDA), resuming from the newest checkpoint
    train_t = cached(train_step, TRAIN_CACHE, root, "train" in refresh).with_options(
        retries=config.training.max_restarts, retry_delay_seconds=5, retry_condition_fn=retry_on_infrastructure
    )
    state = train_t(
        manifest_uri, manifest_hash, config, train, fresh="train" in refresh, parent=parent, return_state=True
    )
    trained, ran["train"] = state.result(), state.name != "Cached"
    trim()

    scores, ran["evaluate"] = run_cached(
        evaluate, EVALUATE_CACHE, root, "evaluate" in refresh, manifest_uri, trained, config, sample_file(snapshot)
    )

    registered, ran["register"] = run_cached(
        register, REGISTER_CACHE, root, "register" in refresh, config, snapshot, manifest_uri, trained, scores
    )
    if not ran["register"]:
        registered = with_alias_now(registered, config)

    # the Prefect runs name what they produced: the runs list filters by model, version and MLflow run
    version = f"{registered.model_name}/{registered.version}"
    found = [f"model:{registered.model_name}", f"model-version:{version}", f"mlflow-run:{registered.run_id}"]
    held = "(no alias now)" if registered.alias == "none" else registered.alias  # a version moved off by hand
    links.tag_flow_run(found, name=f"{config.name} · {registered.model_name} v{registered.version} {held}")
    if trained.flow_run_id:  # the training flow run that trained these weights
        links.tag_flow_run(found[:2], flow_run_id=trained.flow_run_id)

    return {
        "steps": {step: ("ran" if did else "cached") for step, did in ran.items()},
        "snapshot": {
            "files": len(snapshot.files),
            "skipped": [r.model_dump() for r in snapshot.rejected],
            "fingerprint": snapshot.fingerprint,
        },
        "manifest": manifest_uri,
        "train": {
            k: getattr(trained, k)
            for k in (
                "best_checkpoint",
                "best_epoch",
                "select_by",
                "best_score",
                "best_val_loss",
                "steps",
                "device",
                "precision",
                "mlflow_run_id",
                "host",
                "flow_runs",
                "flow_run_id",
                "resumed_from",
                "run_dir",
                "cost",
            )
        },
        "metrics": scores.metrics,
        "baseline": scores.baseline,
        "baseline_name": baseline_name(config),
        "table": scores.table,
        "weak": no_better_than_baseline(config, scores.metrics, scores.baseline),  # '' when it beats the baseline
        "registered": registered.model_dump(),
    }


def sample_file(snapshot) -> tuple[str, int] | None:
    """A raw file of the data (the first; its URI and size): the types its key columns come in, for the predictions
    evaluation keys."""
    return (snapshot.files[0].uri, snapshot.files[0].size) if snapshot.files else None
