"""The training loop: one straight step, validation per epoch, checkpoints that resume bit-exactly.

A checkpoint holds everything the next step depends on: model, optimizer, GradScaler, every RNG, the
loader position (epoch, windows already yielded), the loop counters (global step, step within the
epoch, the epoch's running train loss) and the history. The LR is a pure function of the global step,
so there is no scheduler state. Restoring one and continuing gives the same weights, to the bit, as a
run that never stopped (on the same device, precision and thread count).

Checkpoints are taken at each epoch end, every `checkpoint_every_steps` optimizer steps, and at the first
step boundary `checkpoint_every_seconds` after the last one; the cadence changes when state is saved,
never what is computed, so it may change across a resume. A process killed anywhere (SIGKILL included)
resumes from its newest complete checkpoint; SIGTERM/SIGINT save one first and raise `Preempted`, which
a script turns into exit status PREEMPTED_EXIT_CODE (tests/test_resume_kill.py kills real processes).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardline.core import settings
from shardline.core.config import (
    TrainingConfig,
    is_ranking_validation,
    resolve_selection,
    validation_metrics,
    validation_name,
    validation_ranking_names,
)
from shardline.core.failures import BudgetExceeded, Preempted
from shardline.core.split_ranking import SplitRanking
from shardline.core.storage import join
from shardline.core.text_metrics import perplexity
from shardline.trainer.checkpoint import (
    best_checkpoint,
    checkpoint_name,
    clear_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    point_best,
    remove_temp_files,
    save_checkpoint,
)
from shardline.trainer.contract import (
    DataSpec,
    ModelContractError,
    as_outputs,
    check_loss,
    check_outputs,
    default_loss,
    freeze,
    load_matching,
    model_loss,
)
from shardline.trainer.data import ScoredLoader, SplitData, WindowLoader, check_cache_room, target_names
from shardline.trainer.device import autocast, needs_grad_scaler, pick_device, pick_precision
from shardline.trainer.distributed import all_sum, check_batch_size, from_main, gather_to_main, rank_bounds, world
from shardline.trainer.graphed import GraphedStep, graphs_blocker, match_optimizer, set_lr
from shardline.trainer.models import data_spec_of, model_from_spec

TASKS = ("classification", "regression")
# measured, so never the same twice
TIMING_KEYS = ("windows_per_s", "seconds", "val_seconds", "data_wait_fraction")
STEP_POINTS = 200  # train/* points a run logs when fit's step_every is None: every total_steps // 200 steps
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: what a script exits with on `Preempted`; "run me again to resume"
BUDGET_EXIT_CODE = 76  # what a script exits with on `BudgetExceeded`: "raise the limit and run me again to resume"


# the signal a rank stops for when another process of a run in several was stopped (their step's all-reduce)
ANOTHER_PROCESS = "SIGTERM to another process"


@dataclass(frozen=True)
class Deadline:
    """When `fit` stops: at the first optimizer step boundary once `time.monotonic()` reaches `at`, it saves a
    checkpoint and raises `BudgetExceeded`, whose message starts with `reason()` (the limit and the spend)
    and names the limit to raise (`limit`: "max_cost" or "max_hours")."""

    at: float
    reason: Callable[[], str]
    limit: str = "max_cost"

    def exceeded(self, checkpoint: str | None) -> BudgetExceeded:
        where = f"checkpoint saved at {checkpoint}" if checkpoint else "no checkpoint yet"
        return BudgetExceeded(
            f"training stopped at its budget: {self.reason()}; {where}: raise training.{self.limit} and run again "
            "to resume",
            checkpoint,
        )


def planned_steps(train_windows: int, cfg: TrainingConfig) -> tuple[int, int]:
    """(optimizer steps per epoch, in all) of a run on `train_windows` windows: a last short batch and a last
    short group of micro-batches count; `max_steps_per_epoch` caps an epoch."""
    batches = -(-train_windows // cfg.batch_size)
    per_epoch = -(-batches // cfg.grad_accum)
    if cfg.max_steps_per_epoch:
        per_epoch = min(per_epoch, cfg.max_steps_per_epoch)
    return per_epoch, cfg.epochs * per_epoch


@dataclass
class FitResult:
    best_checkpoint: str
    last_checkpoint: str
    best_score: float  # the best epoch's `select_by`
    # one entry per epoch: epoch (0-based), step, train_loss, val_loss, val_accuracy|val_mae, lr, windows_per_s,
    # seconds (the epoch's training and validation), val_seconds (its validation), data_wait_fraction
    history: list[dict]
    steps: int  # optimizer steps taken in total
    device: str
    precision: str
    resumed_from: str | None
    run_meta: dict = field(default_factory=dict)  # as stored in the checkpoints (the first run's, on resume)
    best_epoch: int | None = None  # 1-based, as the logs count epochs: the epoch of best_checkpoint
    select_by: str = "val_loss"  # the validation metric that chose it


# ---------------------------------------------------------------- pieces of the step


def lr_at(step: int, cfg: TrainingConfig, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr_ratio*lr, or constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return cfg.lr
    ratio = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    min_lr = cfg.min_lr_ratio * cfg.lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - min_lr)


def make_optimizer(model: nn.Module, cfg: TrainingConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (Linear / attention weights) only, not on biases, norms or embeddings:
    decaying an embedding table shrinks rare categories towards zero just for being rare."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen ones (training.freeze) are left alone
    decay = [p for p in trained if p.dim() >= 2 and id(p) not in embeddings]
    rest = [p for p in trained if not (p.dim() >= 2 and id(p) not in embeddings)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=device.type == "cuda")


def batch_targets(data: DataSpec, batch) -> dict[str, torch.Tensor]:
    """A batch's targets by name, in the spec's order (as the shards store them)."""
    return {t.name: y for t, y in zip(data.targets, batch.targets)}


def masked_logits(out: torch.Tensor) -> torch.Tensor:
    """Class 0 is 'unseen': never a prediction (the class axis is the last)."""
    out = out.float().clone()
    out[..., 0] = float("-inf")
    return out


def score_names(spec: DataSpec) -> dict[str, str]:
    """The validation score of each target, as the history names it: `val_accuracy` (classification) or
    `val_mae` (regression, standardised units) for one target, `val_<target>/accuracy` for several."""
    return {t.name: validation_name(t.name, t.kind, len(spec.targets) > 1) for t in spec.targets}


def is_better(score: float, best: float | None, direction: str) -> bool:
    """Whether an epoch's selection score beats the best so far: strictly (a tie keeps the earlier epoch);
    a score that is not finite never does, except as the first."""
    if best is None:
        return True
    if not math.isfinite(score):
        return False
    return not score >= best if direction == "minimize" else not score <= best


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: SplitData,
    task: str,
    batch_size: int,
    device: torch.device,
    ctx=None,
    spec: DataSpec | None = None,
    weights: dict[str, float] | None = None,
    ranking: SplitRanking | None = None,
) -> dict:
    """val_loss (the model's own loss when it defines one) plus, per target, its accuracy (classification;
    id-0 targets count as wrong) or mean absolute error (standardised units), named by `score_names`
    (every position counted when the target is predicted at every position), and the means of what the
    model's own `metrics(outputs, cont, cat, targets)` returns, as `val_<name>`. Ranking data (`ranking`,
    `data`'s split's rows): the first target's ranking metrics, as evaluation computes them on the test
    split, named by `validation_ranking_names` (`val_ndcg_at_10`)."""
    spec = spec or data_spec_of(model.shardline_spec)
    names = score_names(spec)
    own_metrics = getattr(model, "metrics", None)
    own_metrics = own_metrics if callable(own_metrics) else None
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums = {t.name: torch.zeros((), dtype=torch.float64, device=device) for t in spec.targets}
    counts = dict.fromkeys(sums, 0)
    extra: dict[str, torch.Tensor] = {}
    ignore = spec.ignore_id  # text: <pad> targets count nowhere
    token_loss = torch.zeros((), dtype=torch.float64, device=device)  # text: the perplexity's token-level sum
    first = 0  # the batch's first window number: batches come in window order
    if ranking is not None:
        ranking.begin()
    # text: non-overlapping windows, each target token scored once (`ScoredLoader`)
    loader = ScoredLoader(data, batch_size, stride=ignore is not None, ignore=ignore or 0)
    for batch in loader:
        b = batch.to(device)
        targets = batch_targets(spec, b)
        with ctx or contextlib.nullcontext():
            outputs = as_outputs(model(b.cont, b.cat), spec)
        if getattr(model, "loss", None) is not None:  # the model's own objective, a batch mean
            loss_sum += model_loss(model, outputs, b.cont, b.cat, targets, spec, weights).double() * len(b)
        else:
            loss_sum += default_loss(outputs, targets, spec, weights, reduction="sum").double()
        for t in spec.targets:
            out, y = outputs[t.name].float(), targets[t.name]
            if t.kind == "classification" and ignore is not None:
                real = y != ignore
                sums[t.name] += ((masked_logits(out).argmax(dim=-1) == y) & real).sum()
                counts[t.name] += int(real.sum())
                token_loss += F.cross_entropy(
                    out.reshape(-1, out.shape[-1]), y.long().reshape(-1), ignore_index=ignore, reduction="sum"
                ).double()
                continue
            if t.kind == "classification":
                sums[t.name] += (masked_logits(out).argmax(dim=-1) == y).sum()
            else:
                sums[t.name] += (out.reshape(y.shape) - y).abs().sum().double()
            counts[t.name] += y.numel()
        if own_metrics is not None:
            for key, value in dict(own_metrics(outputs, b.cont, b.cat, targets)).items():
                extra[key] = extra.get(key, 0.0) + torch.as_tensor(value, device=device).double().detach() * len(b)
        if ranking is not None:  # the relevance target's outputs as evaluation scores them
            t = spec.targets[0]
            y = outputs[t.name].float()
            y = torch.softmax(masked_logits(y), dim=-1) if t.kind == "classification" else y.reshape(len(b), -1)
            held = data.open_shards  # the loader's: left as they are
            try:
                shard, row = data.target_rows_of(np.arange(first, first + len(b)))
            finally:
                data.release(held)
            ranking.update(shard, row, y.cpu().numpy())
        first += len(b)
    model.train(was_training)
    n = max(1, loader.n_windows)
    out = {"val_loss": loss_sum.item() / n}
    out.update({names[k]: v.item() / max(1, counts[k]) for k, v in sums.items()})
    if ignore is not None and spec.targets:  # text: exp of the mean loss over the target tokens
        out["val_perplexity"] = perplexity(token_loss.item() / max(1, sum(counts.values())))
    out.update({f"val_{k}": float(v.item()) / n for k, v in extra.items()})
    if ranking is not None:
        named = validation_ranking_names(spec.targets[0].name, len(spec.targets) > 1, ranking.ks)
        # a split without a relevant row (a tiny one) has no ranking metric: NaN, never an epoch's best
        ranked = ranking.metrics() if ranking.relevant else dict.fromkeys(named, math.nan)
        out.update({v: ranked[k] for k, v in named.items()})
    return out


@dataclass
class Pace:
    """Windows trained, seconds spent in optimizer steps, and the part of those spent waiting for the next
    batch (in the loader's `next()`: gathering it, or waiting for its threads). On a GPU the step is not
    synchronised, so a single step's split means little; over many it is what the run spends."""

    windows: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0

    def add(self, windows: int, step_s: float, wait_s: float) -> None:
        self.windows += windows
        self.step_s += step_s
        self.wait_s += wait_s

    @property
    def windows_per_s(self) -> float | None:
        return self.windows / self.step_s if self.step_s > 0 else None

    @property
    def wait_fraction(self) -> float | None:
        return self.wait_s / self.step_s if self.step_s > 0 else None


def rng_state() -> dict:
    """Every RNG as tensors and plain lists (loadable with weights_only=True)."""
    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, keys, gauss_next = state["python"]
    random.setstate((version, tuple(keys), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


def _quiet(message: str) -> None:
    """The log of a rank other than 0: rank 0 says what the run does."""


def _seed_rank(seed: int, rank: int, step: int) -> None:
    """RNGs of their own for rank `rank` > 0 (dropout masks differ between ranks, as between the rows of one
    process's batch), derived from the seed, the rank and the step they start at."""
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)


class _StopFlag:
    signal_name: str | None = None


@contextlib.contextmanager
def _stop_on_signals(log: Callable[[str], None]):
    """SIGTERM/SIGINT set a flag the loop checks at each optimizer step; a second SIGINT interrupts at once."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        if flag.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signal_name = signal.Signals(signum).name
        log(f"{flag.signal_name} received: saving a checkpoint at the next optimizer step, then stopping")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _deterministic(device: torch.device, setting: bool | None = None):
    """Deterministic kernels for the duration of a fit (the setting is process-wide): training.deterministic,
    null meaning on the CPU only. On CUDA, cuBLAS needs a fixed workspace too: CUBLAS_WORKSPACE_CONFIG, set
    here when the environment sets none (torch reads it when a cuBLAS handle takes its workspace, so the
    process's first CUDA matmul must come after: in a pipeline, training's)."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    on = device.type == "cpu" if setting is None else setting
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# ---------------------------------------------------------------- checks at the edge


def _plain(obj, what: str):
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be plain JSON data (dicts, lists, strings, numbers): {e}") from None


def _check_inputs(train: SplitData, val: SplitData, spec: DataSpec, task: str | None) -> None:
    if task is not None and task not in TASKS:
        raise ValueError(f"task='{task}' is not a task; allowed: {', '.join(TASKS)} (or None: no target)")
    kinds = [t.kind for t in spec.targets]
    if (kinds[0] if kinds else None) != task:
        raise ValueError(f"the model spec's first target is a {kinds[0] if kinds else 'none'}, task='{task}'")
    for name, data in (("train", train), ("validation", val)):
        if data.n_windows == 0:
            raise ValueError(
                f"the {name} split has no windows: each sequence needs at least window+horizon rows "
                f"(data.window={data.window}, horizon={data.horizon}); shorten data.window or add data"
            )
        if data.tasks != kinds:
            raise ValueError(
                f"the {name} split holds targets {data.tasks} but the model spec's are {kinds} "
                f"({[t.name for t in spec.targets]})"
            )
        if spec.targets and data.positions != spec.targets[0].positions:
            raise ValueError(
                f"the {name} split reads targets at positions '{data.positions}', the model spec at "
                f"'{spec.targets[0].positions}'"
            )
        if data.window != spec.window:
            raise ValueError(f"the model spec has window={spec.window} but the {name} split has window={data.window}")
        if (data.n_cont, data.n_cat) != (spec.n_cont, spec.n_cat):
            raise ValueError(
                f"the {name} split has {data.n_cont} continuous / {data.n_cat} categorical columns, "
                f"the model spec expects {spec.n_cont} / {spec.n_cat}"
            )

        def check_ids(view, s: int, name: str = name) -> None:
            arrays = view.arrays
            cat = np.asarray(arrays["cat"])
            if cat.size and (cat.max(axis=0) >= np.asarray(spec.cardinalities)).any():
                raise ValueError(
                    f"the {name} split has categorical ids beyond the spec's cardinalities {spec.cardinalities} "
                    f"({view.name})"
                )
            for t, array in zip(spec.targets, target_names(arrays)):
                y = arrays[array]
                if t.kind == "classification" and len(y) and int(np.max(y)) >= t.n_classes:
                    raise ValueError(
                        f"the {name} split has class ids of '{t.name}' >= n_classes={t.n_classes} of the model spec "
                        f"({view.name})"
                    )

        # a split in hand: every shard now; a streamed one: each shard as training or validation opens it
        # (no pass of its own before the first step: on S3 that was one more download of the split)
        data.check_each(check_ids)


def _check_same_run(sidecar: dict, spec: dict, training: dict, task: str, windows: dict, ckpt_dir: str) -> None:
    hint = (
        f"delete {ckpt_dir} to train this run from scratch (calling fit() directly: pass another ckpt_dir, "
        "or resume=False to clear it)"
    )
    if sidecar.get("model_spec") != spec:
        raise ValueError(
            f"the checkpoints in {ckpt_dir} belong to another model config "
            f"(saved {sidecar.get('model_spec')}, requested {spec}); {hint}"
        )
    if sidecar.get("task") != task:
        raise ValueError(f"the checkpoints in {ckpt_dir} are for task '{sidecar.get('task')}', not '{task}'; {hint}")
    saved = sidecar.get("training", {})
    changed = sorted(
        k
        for k in set(saved) | set(training)
        if k not in TrainingConfig.RESUMABLE_CHANGES and saved.get(k) != training.get(k)
    )
    if changed:
        diff = ", ".join(f"training.{k}: {saved.get(k)!r} -> {training.get(k)!r}" for k in changed)
        raise ValueError(f"the checkpoints in {ckpt_dir} were trained with other settings ({diff}); {hint}")
    if sidecar.get("windows") != windows:
        raise ValueError(
            f"the checkpoints in {ckpt_dir} were trained on other data (windows {sidecar.get('windows')}, now "
            f"{windows}); {hint}"
        )


# ---------------------------------------------------------------- fit


def preempt_machine(log, step: int) -> None:
    """SIGTERM to this machine's training, as a spot reclaim sends it: to this process (every rank stops at this
    step), and under torch's agent to the agent too (by its first process on the machine), which then stops
    rather than starting a restart round."""
    log(f"SHARDLINE_PREEMPT_AT_STEP={step}: sending myself SIGTERM, as a spot reclaim would")
    signal.raise_signal(signal.SIGTERM)
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        os.kill(os.getppid(), signal.SIGTERM)


def fit(
    train: SplitData,
    val: SplitData,
    model_spec: dict,
    cfg: TrainingConfig,
    task: str | None,
    ckpt_dir: str,
    on_step: Callable[[int, dict], None] | None = None,
    on_epoch: Callable[[int, dict], None] | None = None,
    run_meta: dict | None = None,
    resume: bool = True,
    log: Callable[[str], None] = print,
    step_every: int | None = 10,
    init_weights: dict[str, torch.Tensor] | None = None,
    init_source: str = "",
    on_checkpoint: Callable[[str], None] | None = None,
    on_progress: Callable[[dict], None] | None = None,
    progress_seconds: float = 5.0,
    deadline: Deadline | None = None,
    ranking: SplitRanking | None = None,
) -> FitResult:
    """Train `model_spec` on `train`, validate on `val` every epoch, checkpoint into `ckpt_dir`.

    on_step(step, {"train_loss", "lr"}) every `step_every` optimizer steps (None: every total_steps //
    STEP_POINTS); on_epoch(epoch, history entry) after each epoch's validation, before its checkpoint (so a
    crash re-runs, never skips, a report); on_checkpoint(uri) after each checkpoint is complete;
    on_progress({step, total_steps, epoch (from 1), epochs, train_loss (a recent step's), windows_per_s and
    data_wait_fraction (since the last call), seconds_left, validated_epoch, val_loss, select_by, selected (its
    value), best_epoch, best_score}) when training starts, at the first step boundary `progress_seconds`
    after the last call (so at most one read-back of the loss per call), and at each epoch's end.
    With a `deadline` (a budget), training stops at the first optimizer step boundary past it (an epoch's last
    step: after its validation), saves a checkpoint and raises `BudgetExceeded`; a run already past it when
    it resumes raises before its first step.
    The best checkpoint is the epoch with the best `cfg.select_by` (default val_loss), higher or lower as
    `cfg.select_direction` (default: the metric's own) says; a tie keeps the earlier epoch.
    With resume, the newest complete checkpoint in `ckpt_dir` is restored exactly, mid-epoch included;
    a finished run returns its result without training. Without resume, old checkpoints there are deleted.
    A fresh run starts from `init_weights` (another model's, `init_source` names it) where they match by
    name and shape; `cfg.freeze` prefixes name the parameters that are not trained.
    Ranking data: `ranking` (a `SplitRanking` over `val`'s rows) adds the ranking metrics of its `ks` to each
    epoch's validation (`val_ndcg_at_10`, ...), which `cfg.select_by` may then name.
    """
    spec = _plain(model_spec, "model_spec")
    run_meta = _plain(run_meta or {}, "run_meta")
    data_spec = data_spec_of(spec)
    check_cache_room(train, val, cfg.shuffle_shards)  # before the checks below read every shard
    _check_inputs(train, val, data_spec, task)
    device = pick_device(cfg.device)
    precision = pick_precision(cfg.precision, device)
    # several processes (DDP, trainer/distributed.py): rank 0 alone logs, reports and writes checkpoints
    ranks = world()
    if ranks.distributed:
        check_batch_size(cfg.batch_size, ranks.size)
        if not ranks.is_main:
            on_step = on_epoch = on_checkpoint = on_progress = None
            log = _quiet
    training = cfg.model_dump(mode="json")
    # text data: its target validated as a generation (val_perplexity, val_accuracy on the real target tokens);
    # ranking data: the ranking metrics of the validation split's groups (val_ndcg_at_10, ...)
    known = validation_metrics(
        [(t.name, "generation" if data_spec.text is not None else t.kind) for t in data_spec.targets],
        ranking.ks if ranking else (),
    )
    select_by = cfg.select_by or "val_loss"
    if ranking is None and select_by not in known and is_ranking_validation(select_by):
        raise ValueError(
            f"training.select_by='{select_by}' is a ranking metric of the validation split: pass fit() the split's "
            "rows to rank (ranking=SplitRanking(manifest, manifest_uri, validation split, evaluation.k)), or set "
            "training.select_by to another metric"
        )
    direction = cfg.select_direction or known.get(select_by)
    # stored resolved: a resume compares the selection meant (unset and val_loss are the same one)
    training.update(select_by=select_by, select_direction=direction)
    windows = {"train": train.n_windows, "validation": val.n_windows}
    # test hook, off unless set: sleep after every optimizer step, so that a test can kill a run mid-way
    step_delay = settings.number("SHARDLINE_TEST_STEP_DELAY")
    # test hook, off unless set: sleep while fetching each step's batches, as a starved loader would
    loader_delay = settings.number("SHARDLINE_TEST_LOADER_DELAY")
    # `shardline rehearse`: a run that did not resume preempts itself at this step (SIGTERM, the real path)
    preempt_at = int(settings.number("SHARDLINE_PREEMPT_AT_STEP"))

    removed = remove_temp_files(ckpt_dir)  # left by a process killed inside a write
    if removed:
        log(f"deleted {len(removed)} temp file(s) of an interrupted checkpoint write in {ckpt_dir}")
    found = latest_checkpoint(ckpt_dir) if resume else None
    if ranks.distributed:  # every rank resumes from the checkpoint rank 0 found (or none)
        found = from_main(found)
    if found:
        _check_same_run(found[1], spec, training, task, windows, ckpt_dir)
        side = found[1]
        if side.get("best_checkpoint") and not point_best(ckpt_dir, side["best_checkpoint"]):
            log(f"warning: the best checkpoint {side['best_checkpoint']} in {ckpt_dir} is missing or damaged")
        if side["epoch_complete"] and side["epoch"] == cfg.epochs - 1:
            log(f"training already finished in {ckpt_dir} ({side['step']} steps): returning its result")
            best = best_checkpoint(ckpt_dir)
            return FitResult(
                best_checkpoint=best[0] if best else join(ckpt_dir, side["best_checkpoint"]),
                last_checkpoint=found[0],
                best_score=side["best_score"],
                history=side["history"],
                steps=side["step"],
                device=side["device"],
                precision=side["precision"],
                resumed_from=found[0],
                run_meta={**side.get("run_meta", {}), **run_meta},
                best_epoch=side.get("best_epoch"),
                select_by=select_by,
            )
    elif not resume:
        cleared = clear_checkpoints(ckpt_dir)
        if cleared:
            log(f"resume=False: deleted {len(cleared)} old checkpoint file(s) in {ckpt_dir}")

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = model_from_spec(spec)
    if not data_spec.targets and getattr(model, "loss", None) is None:
        raise ModelContractError(
            f"{type(model).__name__} has no loss(outputs, cont, cat, targets) and the data has no target "
            "(data.targets is empty): define the model's own loss, or declare a target"
        )
    # a name the validation never gives fails here, before any step (a model's own metrics: at the first epoch end)
    resolve_selection(select_by, direction, known, callable(getattr(model, "metrics", None)))
    if init_weights is not None and not found:  # a resumed run has its own weights in its checkpoint
        matched = load_matching(model, init_weights, init_source)
        run_meta = {**run_meta, "init_from": {"source": init_source, **matched}}
        log(
            f"init_from {init_source}: loaded {len(matched['loaded'])} tensor(s), {len(matched['new'])} new "
            f"({', '.join(matched['new'][:8]) or 'none'}), {len(matched['skipped'])} skipped "
            f"({', '.join(matched['skipped'][:8]) or 'none'})"
        )
    frozen = freeze(model, list(cfg.freeze)) if cfg.freeze else []
    if frozen:
        log(f"training.freeze {list(cfg.freeze)}: {len(frozen)} parameter tensor(s) frozen")
    model = model.to(device)
    # training.compile: the step's forward compiled; the module itself (its state_dict) is what is saved
    step_model = torch.compile(model) if cfg.compile else model
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=needs_grad_scaler(precision))
    blocker = graphs_blocker(device, precision, ranks.size) if cfg.cuda_graphs else None
    graphs = cfg.cuda_graphs and blocker is None
    if blocker:
        log(f"note: training.cuda_graphs is set, but every step runs eagerly: {blocker}")
    # chosen once: every precision shares the one step below (a captured step recomputes its casts)
    ctx = autocast(device, precision, cache=not graphs)
    loader = WindowLoader(
        train,
        cfg.batch_size,
        cfg.seed,
        shuffle=True,
        pin_memory=device.type == "cuda",
        num_workers=cfg.num_workers,
        shuffle_shards=cfg.shuffle_shards,
        rank=ranks.rank,
        world_size=ranks.size,
    )
    steps_per_epoch, total_steps = planned_steps(train.n_windows, cfg)
    if step_every is None:
        step_every = max(1, total_steps // STEP_POINTS)
    # settings sized for another data set: said at the start, with the numbers
    if cfg.warmup_steps >= total_steps:
        log(
            f"note: training.warmup_steps={cfg.warmup_steps} is not below this run's {total_steps} optimizer steps "
            f"({cfg.epochs} epochs x {steps_per_epoch}): the learning rate never reaches training.lr={cfg.lr:g}; "
            "lower warmup_steps"
        )
    if cfg.checkpoint_every_steps >= steps_per_epoch and steps_per_epoch > 0:
        log(
            f"note: training.checkpoint_every_steps={cfg.checkpoint_every_steps} is not below an epoch's "
            f"{steps_per_epoch} steps: checkpoints are taken at epoch ends only"
        )

    loop = {
        "step": 0,
        "epoch": 0,
        "epoch_step": 0,
        "epoch_complete": False,
        "train_loss_sum": 0.0,
        "train_windows": 0,
        "best_score": None,
        "best_epoch": None,
        "best_checkpoint": None,
        "last_checkpoint": None,
    }
    history: list[dict] = []
    resumed_from = None
    if found:
        try:
            ckpt = load_checkpoint(found[0])
        except FileNotFoundError:
            if ranks.is_main:
                raise
            raise ValueError(
                f"process {ranks.rank} cannot read {found[0]}, the checkpoint rank 0 resumes from: with "
                "compute.nodes > 1, storage.root must be storage every node reads (an object store, a shared "
                "volume)"
            ) from None
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler.is_enabled() and ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        loop, history = {"best_epoch": None, **ckpt["loop"]}, list(ckpt["history"])
        run_meta = {**ckpt["run_meta"], **run_meta}
        saved_size = found[1].get("world_size", 1)
        if saved_size == ranks.size:  # each rank's own RNGs (one process: rng_ranks is absent or [rng])
            set_rng_state((ckpt.get("rng_ranks") or [ckpt["rng"]])[ranks.rank])
        else:  # same position in the data; rank 0 continues the saved RNGs, the others start their own
            set_rng_state(ckpt["rng"])
            if ranks.rank:
                _seed_rank(cfg.seed, ranks.rank, loop["step"])
            log(
                f"note: checkpoint was trained by {saved_size} process(es), resuming with {ranks.size}: same "
                "position in the data, same global batches, but not bit-identical to an uninterrupted run"
            )
        resumed_from = found[0]
        if (found[1]["device"], found[1]["precision"]) != (device.type, precision):
            log(
                f"note: checkpoint was trained on {found[1]['device']}/{found[1]['precision']}, resuming on "
                f"{device.type}/{precision}: the result will not be bit-identical to an uninterrupted run"
            )
        log(
            f"resuming from {found[0]}: epoch {loop['epoch'] + 1}, step {loop['step']}, "
            f"{loader.offset}/{loader.n_windows} windows of the epoch done"
        )

    match_optimizer(optimizer, device, graphs)  # also over a checkpoint's groups, which bring their own form

    ddp = None
    if ranks.distributed:
        from torch.nn.parallel import DistributedDataParallel

        # the unwrapped `model` is what is saved, validated and handed back; the step goes through `ddp`,
        # whose backward averages the ranks' gradients (the losses are weighted below so that the average is
        # the gradient of the global batch)
        ddp = DistributedDataParallel(
            model, device_ids=[torch.cuda.current_device()] if device.type == "cuda" else None
        )
        step_model = torch.compile(ddp) if cfg.compile else ddp
        if found is None and ranks.rank:  # the same weights everywhere (seeded alike), but each rank its own dropout
            _seed_rank(cfg.seed, ranks.rank, 0)

    last_save = time.monotonic()  # checkpoint_every_seconds counts from here and from the end of each save

    def save(is_best: bool) -> str:
        nonlocal last_save
        loop["last_checkpoint"] = checkpoint_name(loop["step"])
        if is_best:
            loop["best_checkpoint"] = loop["last_checkpoint"]
        rngs = gather_to_main(rng_state()) if ranks.distributed else None  # every rank's RNGs, on rank 0
        if not ranks.is_main:
            # rank 0 writes it; every rank restarts checkpoint_every_seconds' clock (one rank's `due` is all's)
            last_save = time.monotonic()
            return join(ckpt_dir, loop["last_checkpoint"])
        state = {
            "format": 1,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
            **({"rng_ranks": rngs} if rngs else {}),
            "loader": loader.state_dict(),
            "loop": dict(loop),
            "history": history,
            "run_meta": run_meta,
            "model_spec": spec,
            "training": training,
            "task": task,
        }
        meta = {
            **{
                k: loop[k]
                for k in ("epoch", "epoch_step", "epoch_complete", "best_score", "best_epoch", "best_checkpoint")
            },
            "loader": loader.state_dict(),
            "metrics": history[-1] if history and loop["epoch_complete"] else {},
            "history": history,
            "run_meta": run_meta,
            "model_spec": spec,
            "training": training,
            "task": task,
            "windows": windows,
            "device": device.type,
            "precision": precision,
            "steps_per_epoch": steps_per_epoch,
            "world_size": ranks.size,
        }
        uri = save_checkpoint(ckpt_dir, loop["step"], state, meta, is_best=is_best, keep=cfg.keep_checkpoints)
        if on_checkpoint is not None:
            on_checkpoint(uri)
        last_save = time.monotonic()
        return uri

    checked = False

    def train_step(micro: list, real: list[int], weight: list[float], n_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: forward, loss and backward of each micro-batch, clipping, the update. Returns the
        step's loss (the global batch's mean) and this process's part of the epoch's loss sum, on the device
        (no value is read back here: a CUDA graph can capture this function whole)."""
        nonlocal checked
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        part = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(micro):
            b = batch.to(device, non_blocking=True)
            targets = batch_targets(data_spec, b)
            with ctx:
                outputs = as_outputs(step_model(b.cont, b.cat), data_spec)
                if not checked:  # the contract, on the run's first batch: before any step is taken
                    check_outputs(outputs, data_spec, len(b))
                loss = model_loss(model, outputs, b.cont, b.cat, targets, data_spec, cfg.loss_weights)
            if not checked:
                check_loss(loss, loop["step"] + 1, model)
                checked = True
            # gradients add up over micro-batches: scale each so the step follows their mean
            # (len(micro) is grad_accum except for an epoch's last, shorter group)
            if ddp is None:
                scaler.scale(loss / len(micro)).backward()
            else:  # the ranks' gradients are averaged once, at the step's last micro-batch
                with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    scaler.scale(loss * weight[i] / len(micro)).backward()
            step_loss += loss.detach().double() * (real[i] / n_step)
            part += loss.detach().double() * (len(b) if ddp is None else real[i])
        if cfg.grad_clip is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        return step_loss, part

    # training.cuda_graphs: full steps (grad_accum full batches) replay one captured graph
    graphed = (
        GraphedStep(
            lambda bs: train_step(bs, [len(b) for b in bs], [1.0] * len(bs), sum(len(b) for b in bs)),
            (cfg.batch_size,) * cfg.grad_accum,
            optimizer,
            [p for p in model.parameters() if p.requires_grad],
            device,
            log,
        )
        if graphs
        else None
    )
    name = spec["model"].get("entrypoint") or spec["model"]["family"]
    log(
        f"training {name} ({sum(p.numel() for p in model.parameters()):,} parameters) on "
        f"{device.type}/{precision}: {cfg.epochs} epochs x {steps_per_epoch} steps, {train.n_windows:,} train windows; "
        f"the best checkpoint is the epoch with the {'highest' if direction == 'maximize' else 'lowest'} {select_by} "
        "(training.select_by)"
    )

    # where the run is, for on_progress: cheap to build, and built only when it is due
    started, steps_before, span = time.perf_counter(), loop["step"], Pace()
    last_loss: float | None = None

    def report(epoch: int) -> None:
        nonlocal span
        validated = history[-1] if history else {}
        done = loop["step"] - steps_before
        on_progress(
            {
                "step": loop["step"],
                "total_steps": total_steps,
                "epoch": epoch + 1,
                "epochs": cfg.epochs,
                "train_loss": last_loss,
                "windows_per_s": span.windows_per_s,
                "data_wait_fraction": span.wait_fraction,
                "seconds_left": (time.perf_counter() - started) / done * (total_steps - loop["step"]) if done else None,
                "validated_epoch": validated["epoch"] + 1 if validated else None,
                "val_loss": validated.get("val_loss"),
                "select_by": select_by,
                "selected": validated.get(select_by),
                "best_epoch": loop["best_epoch"],
                "best_score": loop["best_score"],
            }
        )
        span = Pace()

    resumed_mid_epoch = found is not None and not loop["epoch_complete"]
    first_epoch = loop["epoch"] if resumed_mid_epoch else (loop["epoch"] + 1 if found else 0)
    if on_progress is not None:
        report(first_epoch)
    last_report = time.perf_counter()
    stop_at = deadline.at if deadline is not None else math.inf  # one clock compare a step
    spent = time.monotonic() >= stop_at
    if ddp is not None and deadline is not None:  # agreed: a rank that left here would hang the others' steps
        spent = all_sum([float(spent)], device)[0] > 0
    if spent:  # spent before this attempt trained a step: nothing new to save
        raise deadline.exceeded(found[0] if found else None)
    with _deterministic(device, cfg.deterministic), _stop_on_signals(log) as stop:
        for epoch in range(first_epoch, cfg.epochs):
            if not (resumed_mid_epoch and epoch == first_epoch):
                loader.set_epoch(epoch)
                loop.update(epoch=epoch, epoch_step=0, epoch_complete=False, train_loss_sum=0.0, train_windows=0)
            loss_sum = torch.tensor(loop["train_loss_sum"], dtype=torch.float64, device=device)
            t0, windows_done, report_every = time.perf_counter(), 0, max(1, steps_per_epoch // 10)
            pace, step_loss = Pace(), None
            lr = lr_at(loop["step"], cfg, total_steps)
            batches = iter(loader)
            model.train()
            while loop["epoch_step"] < steps_per_epoch:
                fetch = time.perf_counter()
                at = loader.offset  # the global position: each micro-batch is a global batch's share (DDP)
                micro = list(itertools.islice(batches, cfg.grad_accum))
                if loader_delay:
                    time.sleep(loader_delay)
                fetched = time.perf_counter()
                if not micro:
                    break
                n_step = sum(len(m) for m in micro) if ddp is None else loader.offset - at  # the global batches'
                # DDP: (this rank's real windows, the global batch's) of each micro-batch; DDP averages the
                # ranks' gradients, so a rank's batch-mean loss weighs real * W / k (exactly the mean over the
                # global batch, also for an uneven last batch; an empty share trains one window at weight 0)
                real = [len(m) for m in micro]  # windows of each micro-batch that count
                weight = [1.0] * len(micro)  # of each micro-batch's loss, before the 1 / len(micro)
                if ddp is not None:
                    ks = [min(cfg.batch_size, n_step - i * cfg.batch_size) for i in range(len(micro))]
                    real = [(lambda lo, hi: hi - lo)(*rank_bounds(k, ranks.rank, ranks.size)) for k in ks]
                    weight = [r * ranks.size / k for r, k in zip(real, ks)]
                lr = lr_at(loop["step"], cfg, total_steps)
                set_lr(optimizer, lr)
                if graphed is not None and graphed.takes(micro):
                    step_loss, part = graphed(micro)
                else:
                    step_loss, part = train_step(micro, real, weight, n_step)
                optimizer.zero_grad(set_to_none=True)
                if ddp is None:  # several processes: their parts are summed below
                    loss_sum += part
                loop["step"] += 1
                loop["epoch_step"] += 1
                loop["train_windows"] += n_step
                windows_done += n_step
                if step_delay:
                    time.sleep(step_delay)
                now = time.perf_counter()
                pace.add(n_step, now - fetch, fetched - fetch)
                span.add(n_step, now - fetch, fetched - fetch)
                if preempt_at and loop["step"] == preempt_at and resumed_from is None:
                    preempt_machine(log, preempt_at)

                stopping = stop.signal_name
                every, seconds = cfg.checkpoint_every_steps, cfg.checkpoint_every_seconds
                due = bool(seconds and time.monotonic() - last_save >= seconds)
                spent = time.monotonic() >= stop_at
                if ddp is not None:  # one all-reduce: the global batch's loss, and any rank's stop, save or budget
                    step_loss, summed, n_stop, n_due, n_spent = all_sum(
                        [step_loss.item(), part.item(), float(bool(stopping)), float(due), float(spent)], device
                    )
                    step_loss = torch.tensor(step_loss, dtype=torch.float64, device=device)
                    stopping = stopping or (ANOTHER_PROCESS if n_stop else None)
                    due, spent = n_due > 0, n_spent > 0
                    if n_stop and not stop.signal_name:
                        log("another process was stopped: saving a checkpoint at this step, then stopping")
                    loss_sum += torch.tensor(summed, dtype=torch.float64, device=device)

                if on_step is not None and loop["step"] % step_every == 0:
                    check_loss(step_loss.float(), loop["step"], model)  # read back here anyway: no extra sync
                    on_step(loop["step"], {"train_loss": step_loss.item(), "lr": lr})
                if on_progress is not None and now - last_report >= progress_seconds:
                    last_loss = step_loss.item()
                    report(epoch)
                    last_report = now
                if loop["epoch_step"] % report_every == 0 and loop["epoch_step"] < steps_per_epoch:
                    wps = windows_done / max(time.perf_counter() - t0, 1e-9)
                    log(
                        f"  epoch {epoch + 1}/{cfg.epochs} step {loop['epoch_step']}/{steps_per_epoch} "
                        f"loss {step_loss.item():.4f} lr {lr:.2e} {wps:,.0f} windows/s"
                    )
                if ddp is None:  # one process: a signal, the clock and the budget as they are now
                    stopping, spent = stop.signal_name, time.monotonic() >= stop_at
                    due = bool(seconds and time.monotonic() - last_save >= seconds)
                due = due or bool(every and loop["step"] % every == 0)
                # the epoch's last step is checkpointed after validation instead
                if loop["epoch_step"] < steps_per_epoch and (stopping or due or spent):
                    loop["train_loss_sum"] = loss_sum.item()
                    last = save(is_best=False)
                    # one process: a signal during the save stops at it too (several: at the next step, together)
                    stopping = stopping if ddp is not None else stop.signal_name
                    if stopping:
                        raise Preempted(last, stopping)
                    if spent:
                        raise deadline.exceeded(last)

            batches.close()  # a streamed split's shards in flight leave the cache to the validation split
            train_seconds = time.perf_counter() - t0
            loop["train_loss_sum"] = loss_sum.item()
            is_best = False
            # several processes: rank 0 validates (the others wait for it at the checkpoint's collective)
            if ranks.is_main:
                metrics = evaluate(model, val, task, cfg.batch_size, device, ctx, data_spec, cfg.loss_weights, ranking)
                val_seconds = time.perf_counter() - t0 - train_seconds
                if select_by not in metrics:  # a model's own metric it did not return: before any epoch is marked best
                    raise ValueError(
                        f"training.select_by='{select_by}' is not a metric this model's validation gives; available: "
                        f"{sorted(metrics)}"
                    )
                if ranking is not None and not ranking.relevant and is_ranking_validation(select_by):
                    raise ValueError(
                        f"training.select_by='{select_by}' ranks the validation split's groups, but none of its "
                        f"{val.n_windows:,} rows is relevant (grade > 0), so no ranking metric is defined: set "
                        "training.select_by: val_loss, or give the validation split more groups (data.split)"
                    )
                entry = {
                    "epoch": epoch,
                    "step": loop["step"],
                    "train_loss": loop["train_loss_sum"] / max(1, loop["train_windows"]),
                    **metrics,
                    "lr": lr,
                    "windows_per_s": windows_done / max(train_seconds, 1e-9),
                    "seconds": time.perf_counter() - t0,
                    "val_seconds": val_seconds,
                    "data_wait_fraction": pace.wait_fraction,
                }
                history.append(entry)
                is_best = is_better(entry[select_by], loop["best_score"], direction)
                if is_best:
                    loop["best_score"], loop["best_epoch"] = entry[select_by], epoch + 1
            loop["epoch_complete"] = True
            if on_epoch is not None:
                on_epoch(epoch, {k: v for k, v in entry.items() if k not in ("epoch", "step")})
            last = save(is_best=is_best)
            if ranks.is_main:
                scores = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "val_loss")
                waited = f", data wait {pace.wait_fraction:.0%} of step time" if pace.wait_fraction is not None else ""
                log(
                    f"epoch {epoch + 1}/{cfg.epochs}: train_loss {entry['train_loss']:.4f} val_loss "
                    f"{entry['val_loss']:.4f}{' ' + scores if scores else ''} lr {lr:.2e} "
                    f"{entry['windows_per_s']:,.0f} windows/s {entry['seconds']:.1f}s{waited}"
                    f"{f' (best {select_by})' if is_best else ''}"
                )
            if on_progress is not None:
                last_loss = step_loss.item() if step_loss is not None else last_loss
                report(epoch)
                last_report = time.perf_counter()
            stopping, spent = stop.signal_name, epoch < cfg.epochs - 1 and time.monotonic() >= stop_at
            if ddp is not None:  # every rank stops, or none
                n_stop, n_spent = all_sum([float(bool(stopping)), float(spent)], device)
                stopping, spent = stopping or (ANOTHER_PROCESS if n_stop else None), n_spent > 0
            if stopping:
                raise Preempted(last, stopping)
            if spent:
                raise deadline.exceeded(last)

    if ddp is not None:  # every rank hands back rank 0's account of the run
        loop, history = from_main((loop, history))

    if loop["best_epoch"] is not None:
        log(
            f"best checkpoint: epoch {loop['best_epoch']}/{cfg.epochs} by {select_by} ({loop['best_score']:.4f}), "
            f"{loop['best_checkpoint']}"
        )
    return FitResult(
        best_checkpoint=join(ckpt_dir, loop["best_checkpoint"]),
        last_checkpoint=join(ckpt_dir, loop["last_checkpoint"]),
        best_score=loop["best_score"],
        history=history,
        steps=loop["step"],
        device=device.type,
        precision=precision,
        resumed_from=resumed_from,
        run_meta=run_meta,
        best_epoch=loop["best_epoch"],
        select_by=select_by,
    )


# ---------------------------------------------------------------- inference


def load_model(checkpoint_uri: str) -> nn.Module:
    """The model of a checkpoint (a .pt URI, or a checkpoint folder: its best), rebuilt from its spec, in eval mode."""
    if not checkpoint_uri.endswith(".pt"):
        found = best_checkpoint(checkpoint_uri) or latest_checkpoint(checkpoint_uri)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint_uri}")
        checkpoint_uri = found[0]
    ckpt = load_checkpoint(checkpoint_uri)
    model = model_from_spec(ckpt["model_spec"])
    model.load_state_dict(ckpt["model"])
    return model.eval()


def predict(
    model: nn.Module, data: SplitData, batch_size: int = 4096, device: torch.device | str | None = None
) -> dict[str, np.ndarray]:
    """Each target's outputs in window order, float32: class probabilities with class 0 (unseen) at 0,
    [N, n_classes] (or [N, K, n_classes] at every position), or standardised values [N, 1] (or [N, K])."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    spec = data_spec_of(model.shardline_spec)
    k = spec.window
    out = {}
    for t in spec.targets:
        lead = (data.n_windows, k) if t.positions == "all" else (data.n_windows,)
        out[t.name] = np.empty((*lead, t.n_classes) if t.kind == "classification" else (*lead, 1), np.float32)
        if t.positions == "all" and t.kind == "regression":
            out[t.name] = out[t.name][..., 0]
    was_training = model.training
    model.eval()
    pos = 0
    with torch.inference_mode():
        for batch in WindowLoader(data, batch_size, seed=0, shuffle=False):
            b = batch.to(device)
            outputs = as_outputs(model(b.cont, b.cat), spec)
            for t in spec.targets:
                y = outputs[t.name].float()
                if t.kind == "classification":
                    y = torch.softmax(masked_logits(y), dim=-1)
                out[t.name][pos : pos + len(b)] = y.reshape(out[t.name][pos : pos + len(b)].shape).cpu().numpy()
            pos += len(b)
    model.train(was_training)
    return out
