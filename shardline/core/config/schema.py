"""The config's other sections (`model:`, `training:`, `evaluation:`, `storage:`, `mlflow:`, `compute:`) and the
whole `PipelineConfig`: everything a run does is decided by one."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from shardline.core.config.base import Strict, stable_hash
from shardline.core.config.data import DataConfig, Target
from shardline.core.config.metric_names import (
    _ranking_hint,
    metric_directions,
    metric_key,
    resolve_selection,
    validation_metrics,
)
from shardline.core.secrets import redact

# the gpt family's settings under model.params (nanoGPT's names) -> the model.* key it overrides
GPT_PARAMS = {"d_model": "hidden", "n_layer": "layers", "n_head": "heads", "dropout": "dropout", "bias": None}
# what model.params may set of the frame families' classes (shardline/trainer/models.py: WindowMLP, WindowTransformer)
FAMILY_PARAMS = {
    "mlp": ("hidden", "layers", "dropout", "embedding_dim"),
    "transformer": ("hidden", "layers", "heads", "dropout", "embedding_dim"),
}


class ModelConfig(Strict):
    entrypoint: str | None = Field(
        None,
        description="your own model: 'package.module:Name', a torch.nn.Module class or factory called as "
        "Name(spec, **model.params) (README: the model contract); unset: the built-in `family`",
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the entrypoint (or extra ones of a built-in family)"
    )
    code_dir: str | None = Field(
        None,
        description="the folder the entrypoint's module is imported from (default: the config file's folder; "
        "the working directory is searched too)",
    )
    requirements: list[str] = Field(
        default_factory=list,
        description="pip requirements of your model beyond the packages its code imports (found and pinned at "
        "registration), each with a version: 'name==1.2' (a package imported by name at run time, say); a bare name "
        "is refused (it could resolve to someone else's package)",
    )
    family: Literal["mlp", "transformer", "gpt"] = Field(
        "mlp",
        description="mlp, transformer (windows of frames) or gpt (a decoder-only language model over one token column)",
    )
    hidden: int = Field(256, ge=1, description="MLP width / Transformer and GPT d_model")
    layers: int = Field(2, ge=1, description="MLP blocks / Transformer and GPT layers (n_layer)")
    heads: int = Field(4, ge=1, description="Transformer and GPT attention heads (n_head)")
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    embedding_dim: int | None = Field(
        None, ge=1, description="per-categorical embedding width (default: min(32, 1.6*vocab**0.56))"
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        for line in self.requirements:
            from packaging.requirements import InvalidRequirement, Requirement

            try:
                req = Requirement(line)
            except InvalidRequirement as e:
                raise ValueError(f"model.requirements: {line!r} is not a pip requirement ({e})") from None
            if not (req.specifier or req.url):
                raise ValueError(
                    f"model.requirements: {line!r} names no version: pin it ('{req.name}==X.Y'), a bare name could "
                    "resolve to someone else's package"
                )
        if self.entrypoint is not None:
            module, sep, attr = self.entrypoint.partition(":")
            if not (sep and module and attr) or " " in self.entrypoint:
                raise ValueError(
                    f"model.entrypoint='{self.entrypoint}' is not 'package.module:Name' (the module, a colon, the "
                    "class or factory in it), e.g. 'models.world:WorldModel'"
                )
            return self
        if self.family == "transformer" and self.hidden % self.heads:
            raise ValueError(
                f"model.hidden={self.hidden} must be divisible by model.heads={self.heads} for a transformer"
            )
        if self.family == "gpt":
            self.gpt_params()  # checked here: an error names the key
        elif unknown := [k for k in self.params if k not in FAMILY_PARAMS[self.family]]:
            import difflib

            close = {k: difflib.get_close_matches(k, FAMILY_PARAMS[self.family], n=1) for k in unknown}
            hint = "".join(f"; did you mean model.params.{c[0]} for {k}?" for k, c in close.items() if c)
            raise ValueError(
                f"model.params {unknown} are not settings of the built-in {self.family} family, which takes "
                f"{list(FAMILY_PARAMS[self.family])}{hint} (your own model's: set model.entrypoint)"
            )
        return self

    def gpt_params(self) -> dict:
        """The gpt family's keyword arguments: model.params under nanoGPT's names (d_model, n_layer, n_head,
        dropout, bias) where given (they win), else model.hidden, layers, heads, dropout; checked, each error
        naming its key."""
        given = dict(self.params)
        unknown = sorted(set(given) - set(GPT_PARAMS))
        if unknown:
            raise ValueError(f"model.params {unknown} are not gpt settings; allowed: {list(GPT_PARAMS)}")
        if self.embedding_dim is not None:
            raise ValueError("model.embedding_dim is not a gpt setting: its token embedding is d_model wide")
        out = {
            "d_model": given.get("d_model", self.hidden),
            "n_layer": given.get("n_layer", self.layers),
            "n_head": given.get("n_head", self.heads),
            "dropout": given.get("dropout", self.dropout),
            "bias": given.get("bias", False),
        }
        where = {k: f"model.params.{k}" if k in given else f"model.{GPT_PARAMS[k] or k}" for k in out}
        for key in ("d_model", "n_layer", "n_head"):
            if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1:
                raise ValueError(f"{where[key]}={out[key]!r} must be a whole number >= 1")
        if (
            isinstance(out["dropout"], bool)
            or not isinstance(out["dropout"], int | float)
            or not 0 <= out["dropout"] < 1
        ):
            raise ValueError(f"{where['dropout']}={out['dropout']!r} must be a number in [0, 1)")
        if not isinstance(out["bias"], bool):
            raise ValueError(f"model.params.bias={out['bias']!r} must be true or false")
        if out["d_model"] % out["n_head"]:
            raise ValueError(
                f"{where['d_model']}={out['d_model']} must be divisible by {where['n_head']}={out['n_head']}: each "
                "attention head gets d_model / n_head of the width"
            )
        return out


class TrainingConfig(Strict):
    # settings a run may change between a checkpoint and its resume: they do not change what is trained
    # (device and precision may change the arithmetic: a resume on other hardware is allowed, not bit-exact)
    RESUMABLE_CHANGES: ClassVar[tuple[str, ...]] = (
        "device",
        "precision",
        "num_workers",
        "compile",
        "cuda_graphs",
        "deterministic",
        "checkpoint_every_steps",
        "checkpoint_every_seconds",
        "keep_checkpoints",
        # budgets stop a run cleanly at a checkpoint; raising one resumes it in the same run folder
        "max_hours",
        "max_cost",
        "max_restarts",  # how often a failed attempt is tried again
    )

    epochs: int = Field(3, ge=1)
    batch_size: int = Field(256, ge=1)
    lr: float = Field(1e-3, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(50, ge=0, description="linear warm-up, in optimizer steps")
    min_lr_ratio: float = Field(0.05, ge=0, le=1, description="cosine floor as a fraction of lr")
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm; null disables clipping")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    checkpoint_every_steps: int = Field(0, ge=0, description="0: only at epoch end")
    checkpoint_every_seconds: float = Field(
        0, ge=0, description="also checkpoint when this long has passed since the last one; 0: off"
    )
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept, besides the best")
    max_restarts: int = Field(
        2,
        ge=0,
        description=(
            "retries of the training step after an infrastructure failure (I/O, network, CUDA); code errors "
            "are never retried"
        ),
    )
    init_from: str | None = Field(
        None,
        description="start from another model's weights, matched by name and shape: a registered model "
        "(models:/name@alias, models:/name/3) or a checkpoint in storage (a .pt file or a run's checkpoint folder)",
    )
    freeze: list[str] = Field(
        default_factory=list, description="parameter name prefixes not trained (e.g. a backbone: ['encoder.'])"
    )
    loss_weights: dict[str, float] = Field(
        default_factory=dict, description="target column -> weight of its loss in the sum (default 1 each)"
    )
    max_steps_per_epoch: int | None = Field(None, ge=1, description="cap optimizer steps per epoch (quick runs)")
    max_hours: float | None = Field(
        None,
        gt=0,
        description="stop training (a checkpoint first) once the run's attempts have trained this many hours in "
        "all, time redone after an interruption included; raise it and run again to resume; null: no limit",
    )
    max_cost: float | None = Field(
        None,
        gt=0,
        description="stop training (a checkpoint first) once the run's estimated spend reaches this many USD "
        "(GPU-hours x the price table's rate: compute.provider, compute.spot); raise it and run again to resume",
    )
    select_by: str | None = Field(
        None,
        description="the validation metric that picks the best checkpoint (the one evaluated and registered), as "
        "the epoch history names it: val_loss, val_accuracy, val_mae, val_<target>/accuracy, val_<target>/mae, or "
        "val_<name> of your model's own metrics(), and on ranking data (data.group_key) val_ndcg_at_10, "
        "val_map_at_5, val_mrr, ... (evaluation.k's ranking metrics on the validation split); default: the "
        "promotion metric's validation counterpart (accuracy -> val_accuracy, mae -> val_mae, ndcg@10 -> "
        "val_ndcg_at_10), else val_loss",
    )
    select_direction: Literal["maximize", "minimize"] | None = Field(
        None,
        description="whether a higher or a lower select_by is better; default: the metric's own (loss and mae "
        "lower, accuracy higher; mlflow.promotion_direction for the promotion metric); needed only for another "
        "metric of your model's own metrics()",
    )
    num_workers: int | None = Field(
        None,
        ge=0,
        description="loader threads gathering the next batches while one trains (shared memory, no pickling); "
        "null: 2 on a CUDA device (a captured step is fast enough to wait for one thread), 0 elsewhere",
    )
    compile: bool = Field(
        False,
        description="run the training step's forward through torch.compile (for GPUs: it pays off on long runs of "
        "a fixed shape; the first steps wait for the compilation)",
    )
    cuda_graphs: bool | None = Field(
        None,
        description="on a CUDA device, capture the whole optimizer step (forward, loss, backward, clipping, AdamW) "
        "of full batches once as a CUDA graph and replay it: one launch a step instead of hundreds, for models "
        "whose steps wait on Python and kernel launches. null (the default): captured on a CUDA device whenever "
        "the step can be, with a note that says so and what a replay gains over an eager step; true: the same, "
        "and a note when it cannot be; false: every step eager. Each epoch's last, shorter batch, fp16 (its loss "
        "scaler reads the gradients back), several processes and a model's own optimizer (configure_optimizers) "
        "train eagerly; a step that cannot be captured (a model that reads a value back to Python, or changes "
        "shape) says so and the run goes on eagerly. Ignored on the CPU",
    )
    deterministic: bool | None = Field(
        None,
        description="deterministic kernels, so that a run and its resume from a checkpoint end on bit-identical "
        "weights. null: on the CPU only (where they cost nothing measurable); true: on a GPU too (torch's "
        "deterministic algorithms, and cuBLAS's fixed workspace CUBLAS_WORKSPACE_CONFIG=:4096:8 when the "
        "environment sets none; some kernels are slower, an embedding's backward sorts instead of adding "
        "atomically); false: nowhere",
    )
    fold: int | None = Field(
        None,
        ge=0,
        description="k-fold data (data.split.method: kfold): train on every fold but this one and validate on it; "
        "null: train on every fold (the final model), validating on the last fold, which it also trains on",
    )
    shuffle_shards: int | None = Field(
        None,
        ge=1,
        description=(
            "shuffle the train split this many shards at a time (the shards in a permuted order, each block's "
            "windows permuted together), so a split larger than the local cache streams with the cache holding "
            "one block; null: one global shuffle, which needs the whole split in the cache. The order never "
            "depends on the cache"
        ),
    )


class EvaluationConfig(Strict):
    k: list[int] = Field(
        default_factory=lambda: [5, 10],
        description="ranking data (data.group_key): the cutoffs of nDCG@k, MAP@k, recall@k and MRR@k",
    )

    @field_validator("k")
    @classmethod
    def _cutoffs(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("evaluation.k is empty: give at least one cutoff, such as [5, 10]")
        low = [k for k in v if k < 1]
        if low:
            raise ValueError(f"evaluation.k holds {low}: cutoffs are whole numbers >= 1 (the top k of a ranking)")
        return sorted(set(v))

    max_generations: int = Field(
        200,
        ge=0,
        description="a generation target (data.target.task: generation): how many test sequences are generated "
        "greedily for exact match and token F1 (the first N, in the shards' order; 0: none)",
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="a generation target: new tokens per test generation (default: the longest reference + 8, "
        "at most 256)",
    )


class StorageConfig(Strict):
    root: str = Field("./shardline-home/store", description="local path or fsspec URL for shards, checkpoints, results")


class MlflowConfig(Strict):
    tracking_uri: str | None = Field(
        None, description="default: MLFLOW_TRACKING_URI, else sqlite at <storage.root>/mlflow.db (a local root)"
    )
    experiment: str = "shardline"
    model_name: str = "shardline-model"
    promotion_metric: str | None = Field(
        None,
        description="default: the first target's accuracy (classification), rmse (regression), perplexity (text) or "
        "loss (no target)",
    )
    promotion_direction: Literal["maximize", "minimize"] | None = None


DASK_SCHEMES = ("tcp", "tls", "ucx", "ws", "wss", "inproc")  # the comms a Dask scheduler listens on


class ComputeConfig(Strict):
    """Where training runs. Nothing here changes what is trained: switching it never retrains."""

    train_on: Literal["local", "deployment", "launcher"] = Field(
        "local",
        description=(
            "local: a subflow in the pipeline's process; deployment: dispatched to `train_deployment` (a GPU work "
            "pool); launcher: the pipeline runs `launch_command`, whose machines each run `shardline node JOB` (a "
            "TrainJob, JobSet, Slurm or SkyPilot job: deploy/), and follows the training in storage"
        ),
    )
    launch_command: list[str] = Field(
        default_factory=list,
        description=(
            "train_on: launcher: the command that starts the training's machines (argv; `{job}` is replaced by the "
            "job's URI in storage and `{run}` by the run's id), e.g. [sh, -c, \"sed 's|@JOB@|{job}|' "
            'deploy/trainjob.yaml | kubectl create -f -"] (deploy/README.md); it returns once they are submitted'
        ),
    )
    train_deployment: str = Field(
        "train/train", description="'flow/deployment' name the pipeline dispatches training to"
    )
    job_variables: dict[str, Any] = Field(
        default_factory=dict,
        description="per-run overrides of the training deployment's job variables (env, image, resources)",
    )
    processes_per_node: int = Field(
        1,
        ge=1,
        description=(
            "training processes on each machine (DDP through torchrun: one per GPU; gloo on CPU); >1 runs the "
            "training body under `torchrun --nproc-per-node N`; training.batch_size is the global batch and must "
            "divide by nodes x processes_per_node"
        ),
    )
    nodes: int = Field(
        1,
        ge=1,
        description=(
            "machines training together, one torchrun agent each meeting at a c10d rendezvous; >1: the training run "
            "is node 0 and starts the others as flow runs of `node_deployment`, or a launcher starts them all "
            "(train_on: launcher)"
        ),
    )
    node_deployment: str = Field(
        "train-node/train-node",
        description="'flow/deployment' that runs nodes 1.. of a compute.nodes > 1 training (a GPU work pool)",
    )
    master_addr: str | None = Field(
        None,
        description=(
            "the address the other nodes reach the rendezvous at, on node 0's machine (its IP or host name); null: "
            "node 0's own IP, as its host name resolves or its default route leaves"
        ),
    )
    master_port: int | None = Field(
        None, ge=1, le=65535, description="the port node 0's rendezvous listens on; null: a free one"
    )
    join_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description=(
            "how long torchrun's rendezvous waits for all `nodes` (at the start, and after a lost node for its "
            "replacement); then the training fails naming the nodes that came: at the start, not retried; after a "
            "lost node, retried whole from the newest checkpoint"
        ),
    )
    collective_timeout_seconds: float = Field(
        900.0,
        gt=0,
        description=(
            "how long a training process waits in a collective for a peer (a machine gone without a word); then "
            "torch's restart round resumes from the newest checkpoint. Longer than rank 0's validation pass"
        ),
    )
    max_preemptions: int = Field(
        3,
        ge=0,
        description=(
            "re-dispatches of a training run that crashed or was preempted (its machine died); a failed run "
            "is never re-dispatched"
        ),
    )
    dispatch_timeout_seconds: float | None = Field(
        None, gt=0, description="give up waiting for one training run after this long; null: wait"
    )
    poll_seconds: float = Field(5.0, gt=0, description="how often the pipeline checks the training run's state")
    provider: str | None = Field(
        None,
        description="whose prices a run's GPU-hours are costed at (a provider of shardline/configs/prices.yaml or "
        "of your SHARDLINE_PRICES file); null: the cheapest one listed for the machine's GPU type",
    )
    spot: bool = Field(False, description="cost GPU-hours at the provider's spot (interruptible) price")
    task_runner: Literal["threads", "dask"] = Field(
        "threads",
        description=(
            "where the encode's file-group tasks run: threads (this process, data.encode_workers at once) or dask "
            "(the workers of a Dask cluster, one group per worker thread; needs `pip install shardline[dask]`)"
        ),
    )
    dask_address: str | None = Field(
        None,
        description=(
            "task_runner: dask: the scheduler of an existing Dask cluster (tcp://host:8786); null: a local cluster "
            "of dask_workers processes for the run"
        ),
    )
    dask_workers: int | None = Field(
        None, ge=1, description="the local Dask cluster's worker processes (one thread each); null: data.encode_workers"
    )

    @model_validator(mode="after")
    def _dask_settings_need_dask(self) -> ComputeConfig:
        if self.task_runner != "dask":
            for key in ("dask_address", "dask_workers"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"compute.{key} is set but compute.task_runner is '{self.task_runner}'; "
                        "set compute.task_runner: dask, or remove it"
                    )
        if self.dask_address is not None and self.dask_workers is not None:
            raise ValueError(
                "compute.dask_workers sizes a local cluster; with compute.dask_address (an existing "
                "cluster) its workers are what that cluster has: remove compute.dask_workers"
            )
        scheme = (self.dask_address or "").partition("://")[0] if "://" in (self.dask_address or "") else None
        if self.dask_address is not None and scheme not in DASK_SCHEMES:
            raise ValueError(
                f"compute.dask_address '{self.dask_address}' is not a Dask scheduler's address (a scheme of "
                f"{', '.join(DASK_SCHEMES)}); write it as tcp://host:8786 (the port `dask scheduler` prints, not "
                "its dashboard's)"
            )
        return self

    @field_validator("train_deployment")
    @classmethod
    def _flow_slash_deployment(cls, v: str) -> str:
        if v.count("/") != 1 or not all(v.split("/")):
            raise ValueError(f"'{v}' is not 'flow-name/deployment-name' (for example 'train/train')")
        return v


class PipelineConfig(Strict):
    name: str = "shardline"
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)

    @model_validator(mode="after")
    def _defaults(self) -> PipelineConfig:
        size = self.compute.nodes * self.compute.processes_per_node
        if self.training.batch_size % size:  # several processes: each takes an equal share of a global batch
            raise ValueError(
                f"training.batch_size={self.training.batch_size} is not divisible by the world size {size} "
                f"(compute.nodes={self.compute.nodes} x compute.processes_per_node="
                f"{self.compute.processes_per_node}); use a multiple of {size}"
            )
        if self.training.freeze and not self.training.init_from:  # it trained and registered a frozen random backbone
            raise ValueError(
                f"training.freeze {list(self.training.freeze)} without training.init_from: those tensors would keep "
                "the random weights the model is built with, never trained. Set training.init_from to the model whose "
                "weights they keep (models:/name@alias, or a run's checkpoints), or leave training.freeze out (a model "
                "that loads weights of its own freezes them itself: requires_grad_(False) in its __init__)"
            )
        if self.data.features.text and self.data.tokenizer is None and not self.training.init_from:
            raise ValueError(
                "data.features.text needs data.tokenizer: {kind: bpe, vocab_size: 8192} (trained on the training "
                "split) or {file: tokenizer.json}; a fine-tune (training.init_from a text model) uses its parent's"
            )
        targets = self.data.target_list
        if self.data.text_target is not None:  # text: one target over the vocabulary, implied when pre-training
            targets = [Target(column=self.data.text_target, task="generation")]
        if not targets and not self.model.entrypoint:
            raise ValueError(
                "data.target (or data.targets) is required for the built-in model families; only a model of your "
                "own that defines loss(outputs, cont, cat, targets) trains without a target"
            )
        if self.data.target_positions == "all" and not self.model.entrypoint and self.model.family == "mlp":
            why = (
                "text data (data.features.text) predicts" if self.data.features.text else "data.target_positions='all'"
            )
            raise ValueError(
                f"{why} the next token at every position, so it needs a model that predicts every position "
                "(model.family: gpt or transformer, or your own model); the mlp predicts the last position only"
                if self.data.features.text
                else "data.target_positions='all' needs a model that predicts every position: model.family: "
                "transformer (causal over the window), or your own model; the mlp predicts the last position only"
            )
        if not self.model.entrypoint and self.model.family == "gpt":
            self._check_gpt_data()
        metrics = metric_directions(targets, self.evaluation.k if self.data.group_key else ())
        if self.mlflow.promotion_metric is None:
            self.mlflow.promotion_metric = next(iter(metrics))
        chosen = self.mlflow.promotion_metric
        if len(targets) == 1 and chosen.startswith(f"{targets[0].column}/"):  # the one target's name is optional
            chosen = self.mlflow.promotion_metric = chosen.split("/", 1)[1]
        if chosen not in metrics and not targets:  # a metric the model's own `metrics` returns
            if self.mlflow.promotion_direction is None:
                raise ValueError(
                    f"mlflow.promotion_metric='{chosen}' is not the model's own 'loss': if your model's metrics() "
                    "returns it, set mlflow.promotion_direction (maximize or minimize) too"
                )
        elif chosen not in metrics:
            raise ValueError(
                f"mlflow.promotion_metric='{chosen}' is not a metric of "
                + (f"the targets {[t.column for t in targets]}" if targets else "a model without a target")
                + f"; allowed: {sorted(metrics)}"
                + _ranking_hint(chosen, self.data.group_key, self.evaluation.k)
            )
        if self.mlflow.promotion_direction is None:
            self.mlflow.promotion_direction = metrics[chosen]
        # the best checkpoint is chosen the way promotion decides, where validation measures the same thing
        known = validation_metrics(
            [(t.column, t.task) for t in targets], self.evaluation.k if self.data.group_key else ()
        )
        counterpart = "val_" + metric_key(chosen)  # ndcg@10 -> val_ndcg_at_10
        own = {counterpart: self.mlflow.promotion_direction} if chosen not in metrics else {}  # the model's own
        if self.training.select_by is None:
            self.training.select_by = counterpart if counterpart in known or own else "val_loss"
        self.training.select_direction = resolve_selection(
            self.training.select_by, self.training.select_direction, known, self.model.entrypoint is not None, own
        )[1]
        split = self.data.split
        if self.training.fold is not None and split.method != "kfold":
            raise ValueError(
                f"training.fold={self.training.fold} picks a fold of k-fold data: set data.split.method: kfold "
                f"(now {split.method}) and data.split.folds"
            )
        if self.training.fold is not None and self.training.fold >= (split.folds or 0):
            raise ValueError(
                f"training.fold={self.training.fold} is not a fold of data.split.folds={split.folds}: "
                f"allowed 0..{(split.folds or 0) - 1}, or null to train on every fold"
            )
        unknown = sorted(set(self.training.loss_weights) - {t.column for t in targets})
        if unknown:
            raise ValueError(
                f"training.loss_weights names {unknown}, which are not targets; the targets are "
                f"{[t.column for t in targets]}"
            )
        bad = {k: w for k, w in self.training.loss_weights.items() if not (math.isfinite(w) and w >= 0)}
        if bad:  # a negative weight maximises its target's loss
            raise ValueError(f"training.loss_weights {bad}: a weight must be a number >= 0 (0 leaves a target out)")
        return self

    def _check_gpt_data(self) -> None:
        """The gpt family reads one token column (text columns are joined into one) and predicts the next token at
        every position."""
        features = self.data.features
        columns = features.all()
        if features.continuous or features.boolean or (len(columns) != 1 and not features.text):
            raise ValueError(
                f"model.family: gpt reads exactly one token column (a categorical column of token ids, or a text "
                f"column) and no other feature; data.features lists {columns}"
            )
        if self.data.target_positions != "all":
            raise ValueError(
                "model.family: gpt predicts the next token at every position: set data.target_positions: all "
                "(and data.horizon: 1)"
            )

    @model_serializer(mode="wrap")
    def _without_secrets(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict:
        """As JSON (a Prefect flow parameter, the config stored beside a run, MLflow params, the hash), a
        config has its secrets masked (`shardline/core/secrets.py`), unless the caller asks for them:
        `model_dump(mode="json", context=KEEP_SECRETS)` (to build another config in this process)."""
        data = handler(self)
        if info.mode_is_json() and not (isinstance(info.context, dict) and info.context.get("secrets") == "keep"):
            return redact(data)
        return data

    def hash(self) -> str:
        """What the config says, its secrets left out (a rotated password trains nothing again)."""
        return stable_hash(self.model_dump(mode="json"))
