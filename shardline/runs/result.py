"""What the pipeline's steps hand each other: a training run's result (`TrainResult`, kept as `result.json` in the
run's folder), its evaluation's (`EvalResult`), its registration's (`Registered`), and the fine-tune parent they
are handed (`Parent`, resolved by runs/parent.py). A small module of its own:
the steps that read them key their caches on the code they import."""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict

from shardline.core import storage

RESULT_FILE = "result.json"  # read back by shardline.tasks.train.dispatch_training


class Parent(BaseModel):
    """A fine-tune's parent, pinned: a registered model version (`name`, `version`, `run_id`; `uri` is
    models:/name/N, whichever alias named it) or a checkpoint (`checkpoint`, its `sha256`; `uri` is the .pt)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    uri: str
    name: str | None = None
    version: str | None = None
    run_id: str | None = None
    checkpoint: str | None = None
    sha256: str | None = None

    def identity(self) -> dict:
        """What the run folder and the caches key on: the same fields as before it was typed."""
        keys = ("uri", "checkpoint", "sha256") if self.checkpoint else ("uri", "name", "version", "run_id")
        return {k: getattr(self, k) for k in keys}


class TrainResult(BaseModel):
    """What a training run hands the steps after it: the train task's result, and `result.json` in its folder
    (for a dispatcher on another machine: small results, big data in storage). A `result.json` written by a worker
    running another version of the code may hold fields this one does not know: they are left out, not refused."""

    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="constants")

    best_sha256: str | None  # the best checkpoint's checksum: what evaluation keys on
    weights_sha256: str | None = None  # its model weights' alone (`weights_checksum`): a registered version's identity
    parent: Parent | None  # the fine-tune parent, pinned (runs/parent.py)
    run_dir: str
    best_checkpoint: str
    last_checkpoint: str
    best_epoch: int | None  # 1-based, as the logs count epochs
    select_by: str  # the validation metric that chose the best epoch
    best_score: float | None  # the best epoch's select_by
    best_val_loss: float | None  # the best epoch's (the lowest only when select_by is val_loss)
    history: list[dict]  # fit's, one entry per epoch
    steps: int
    device: str
    precision: str
    resumed_from: str | None
    mlflow_run_id: str | None  # None when MLflow was away all along: `shardline sync` creates it
    tracking_uri: str
    host: str
    flow_run_id: str | None  # the Prefect run that finished it
    cost: dict | None  # GPU-hours and USD of every attempt, wasted ones said (an estimate: cost.json)
    flow_runs: list[dict] | None = None  # dispatched to a deployment: its flow runs, each with its final state
    pruned_epoch: int | None = None  # a sweep's trial its pruner stopped after this epoch (1-based)

    @classmethod
    def read(cls, folder: str, flow_runs: list[dict] | None = None) -> TrainResult:
        found = cls.model_validate_json(storage.read_text(storage.join(folder, RESULT_FILE)))
        return found.model_copy(update={"flow_runs": flow_runs}) if flow_runs is not None else found


class Trained(Protocol):
    """What evaluation reads of a training: a `TrainResult`, or `fit`'s own `FitResult`."""

    best_checkpoint: str
    history: list[dict]
    best_epoch: int | None
    select_by: str


class EvalResult(BaseModel):
    """The evaluate task's result: the test split's metrics beside the trivial baseline's, their table, and the
    files it wrote (plots, per-class tables, the test predictions) where they are kept."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    metrics: dict[str, float | None]
    baseline: dict[str, float | None]
    table: str
    test_windows: int
    files: list[str]
    test_tokens: int | None = None  # text: the target tokens scored
    ranking: dict | None = None  # ranking data: the groups ranked, those with a relevant row, the baseline


class Registered(BaseModel):
    """The register task's result: the version registered (or found registered already), its alias, how it
    compared with the champion, and where to see it."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    model_name: str
    version: int
    alias: str  # "champion", or "none" when the champion stayed
    previous_champion: dict | None
    model_uri: str
    run_id: str
    tracking_uri: str  # redacted: a cached result is a file in the storage root
    promotion_metric: str
    value: float | None
    compared: dict | None = None
    already_registered: bool = False  # the same weights, data and training settings were registered before
    run_page: str | None = None  # in the MLflow UI; a SQLite store: `ui_command` serves it there
    version_page: str | None = None
    ui_command: str | None = None
