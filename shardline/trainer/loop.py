"""The training loop: one straight step, validation per epoch, checkpoints that resume bit-exactly.

A checkpoint holds everything the next step depends on: model, optimizer, GradScaler, every RNG, the
loader position (epoch, windows already yielded), the loop counters (global step, step within the
epoch, the epoch's running train loss) and the history. The LR is a pure function of the global step,
so there is no scheduler state. Restoring one and continuing gives the same weights, to the bit, as a
run that never stopped (on the same device, precision and thread count).

Checkpoints are taken at each epoch end, every `checkpoint_every_steps` optimizer steps, and at the first
step boundary `checkpoint_every_seconds` after the last one; the cadence changes when state is saved,
never what is computed, so it may change across a resume. A checkpoint is written by a thread of its own while
training goes on, from a copy of the state (`shardline.trainer.saver`). A process killed anywhere (SIGKILL included)
resumes from its newest complete checkpoint; SIGTERM/SIGINT save one first and raise `Preempted`, which
a script turns into exit status PREEMPTED_EXIT_CODE (tests/test_resume_kill.py kills real processes).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from shardline.core.config import TrainingConfig
from shardline.core.failures import BudgetExceeded, Preempted  # noqa: F401  (fit raises them)
from shardline.core.metrics.split_ranking import SplitRanking
from shardline.core.storage import join
from shardline.trainer.checkpoint import (
    best_checkpoint,
    clear_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    point_best,
    remove_temp_files,
)
from shardline.trainer.checks import check_inputs, check_same_run, plain
from shardline.trainer.contract import (
    DataSpec,
    ModelContractError,
    check_loss,
    freeze,
    is_lazy_model,
    load_matching,
    materialize,
    own_hook,
)
from shardline.trainer.data import SplitData, WindowLoader, check_cache_room
from shardline.trainer.device import pick_device, pick_precision
from shardline.trainer.distributed import World, all_sum, check_batch_size, from_main, world
from shardline.trainer.models import data_spec_of, model_from_spec
from shardline.trainer.saver import Checkpoints
from shardline.trainer.state import Pace, TrainState, seed_all, seed_rank, set_rng_state
from shardline.trainer.step import Step, planned_steps
from shardline.trainer.stops import (  # noqa: F401  (the exit codes: what a script exits with on them)
    ANOTHER_PROCESS,
    BUDGET_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    Deadline,
    deterministic,
    stop_on_signals,
)
from shardline.trainer.validate import check_selected, check_selection, evaluate, selection

# measured, so never the same twice
TIMING_KEYS = ("windows_per_s", "seconds", "val_seconds", "data_wait_fraction")
STEP_POINTS = 200  # train/* points a run logs when step_every is None: every total_steps // 200 steps


def _quiet(message: str) -> None:
    """The log of a rank other than 0: rank 0 says what the run does."""


@dataclass
class Callbacks:
    """What a caller hears of a run (on rank 0 only), and where it may act in it (on every rank).

    on_step(step, {"train_loss", "lr"}) every `FitOptions.step_every` optimizer steps; on_epoch(epoch, history
    entry) after each epoch's validation, before its checkpoint (so a crash re-runs, never skips, a report);
    on_checkpoint(uri, age) once each checkpoint is complete (written meanwhile: `age`
    seconds after its state was taken); on_progress({step, total_steps, epoch (from 1), epochs,
    train_loss (a recent step's), windows_per_s and data_wait_fraction (since the last call), seconds_left,
    validated_epoch, val_loss, select_by, selected (its value), best_epoch, best_score}) when training starts, at
    the first step boundary `FitOptions.progress_seconds` after the last call, and at each epoch's end.
    after_fetch() once a step's batches are in hand (its time counts as waiting for data); after_step(step, resumed)
    after each optimizer step, before the run checks for a stop (`shardline rehearse` preempts itself there).
    prune(epoch, history entry) after each epoch's validation but the last, before its checkpoint (a sweep's pruner,
    one process only): True stops the run after that checkpoint, which records it (a resume with `prune` set
    returns it; one without trains on)."""

    log: Callable[[str], None] = print
    on_step: Callable[[int, dict], None] | None = None
    on_epoch: Callable[[int, dict], None] | None = None
    on_checkpoint: Callable[[str, float], None] | None = None
    on_progress: Callable[[dict], None] | None = None
    after_fetch: Callable[[], None] | None = None
    after_step: Callable[[int, bool], None] | None = None
    prune: Callable[[int, dict], bool] | None = None

    def quiet(self) -> Callbacks:
        return Callbacks(log=_quiet, after_fetch=self.after_fetch, after_step=self.after_step)


@dataclass
class FitOptions:
    """How a run starts and stops. `resume`: the newest complete checkpoint in `ckpt_dir` is restored exactly,
    mid-epoch included (a finished run returns its result without training); False deletes the old ones.
    A fresh run starts from `init_weights` (another model's, `init_source` names it) where they match by name and
    shape. With a `deadline` (a budget), training stops at the first optimizer step boundary past it (an epoch's
    last step: after its validation), saves a checkpoint and raises `BudgetExceeded`; a run already past it when
    it resumes raises before its first step. Ranking data: `ranking` (a `SplitRanking` over the validation rows)
    adds the ranking metrics of its `ks` to each epoch's validation (`val_ndcg_at_10`, ...)."""

    resume: bool = True
    run_meta: dict = field(default_factory=dict)  # stored in the checkpoints (merged over the first run's on resume)
    step_every: int | None = 10  # on_step's cadence; None: every total_steps // STEP_POINTS steps
    progress_seconds: float = 5.0
    init_weights: dict[str, torch.Tensor] | None = None
    init_source: str = ""
    deadline: Deadline | None = None
    ranking: SplitRanking | None = None


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
    pruned_epoch: int | None = None  # 1-based: the epoch after which a sweep's pruner stopped it


def fit(
    train: SplitData,
    val: SplitData,
    model_spec: dict,
    cfg: TrainingConfig,
    task: str | None,
    ckpt_dir: str,
    callbacks: Callbacks | None = None,
    options: FitOptions | None = None,
) -> FitResult:
    """Train `model_spec` on `train`, validate on `val` every epoch, checkpoint into `ckpt_dir`. The best
    checkpoint is the epoch with the best `cfg.select_by` (default val_loss), higher or lower as
    `cfg.select_direction` (default: the metric's own) says; a tie keeps the earlier epoch."""
    opt = options or FitOptions()
    plan = _plan(train, val, model_spec, cfg, task, opt)
    ranks, device = plan.ranks, plan.device
    cb = callbacks or Callbacks()
    cb = cb if ranks.is_main else cb.quiet()  # rank 0 alone logs and reports; every rank acts
    log, run_meta = cb.log, plain(opt.run_meta, "run_meta")
    found = _find_checkpoint(ckpt_dir, opt.resume, ranks, log)
    if found:
        check_same_run(found[1], plan.spec, plan.training, plan.windows, ckpt_dir)
        finished = _finished(found, ckpt_dir, cfg, plan.select_by, run_meta, log, cb.prune is not None)
        if finished is not None:
            return finished
    model, run_meta = _build_model(plan, cfg, opt, found is None, run_meta, log, train)
    step = Step(model, cfg, plan.data, device, plan.precision, ranks, plan.total_steps, log)
    step.metric_names = set(plan.known)
    loader = _loader(train, cfg, plan)
    _notes(plan, cfg, log)
    state = TrainState()
    if found:
        run_meta = _resume(found, step, loader, state, run_meta, cfg, plan, log)
        state.pruned_epoch = state.pruned_epoch if cb.prune is not None else None  # without a pruner: train on
    step.start(fresh=found is None)
    saver = Checkpoints(ckpt_dir, cfg, plan, step, loader, run_meta, task, cb.on_checkpoint, log)
    log(_start_line(plan, cfg, model, train))
    resumed_mid_epoch = found is not None and not state.epoch_complete
    first_epoch = state.epoch if resumed_mid_epoch else (state.epoch + 1 if found else 0)
    progress = _Progress(cb.on_progress, opt.progress_seconds, plan, cfg, state, first_epoch)
    stop_at = opt.deadline.at if opt.deadline is not None else math.inf  # one clock compare a step
    # spent before this attempt trained a step: nothing new to save
    if opt.deadline is not None and _any_rank(plan, None, time.monotonic() >= stop_at)[1]:
        raise opt.deadline.exceeded(found[0] if found else None, saved=False)
    step_loss = None
    with deterministic(device, cfg.deterministic), stop_on_signals(log) as stop, saver:
        for epoch in range(first_epoch, cfg.epochs):
            if not (resumed_mid_epoch and epoch == first_epoch):
                loader.set_epoch(epoch)
                state.start_epoch(epoch)
            loss_sum = torch.tensor(state.train_loss_sum, dtype=torch.float64, device=device)
            t0, windows_done, report_every = time.perf_counter(), 0, max(1, plan.steps_per_epoch // 10)
            pace, batches, lr = Pace(), iter(loader), step.lr(state.step)
            model.train()
            while state.epoch_step < plan.steps_per_epoch:
                fetch, at = time.perf_counter(), loader.offset  # the global position (DDP: each rank has a share)
                micro = list(itertools.islice(batches, cfg.grad_accum))
                if cb.after_fetch is not None:
                    cb.after_fetch()
                fetched = time.perf_counter()
                if not micro:
                    break
                n_step = loader.offset - at  # the windows of the step's global batches
                lr = step.lr(state.step)
                try:
                    step_loss, part = step(micro, n_step, state.step + 1)
                except ValueError as e:  # torch's words name no step or setting: said with them
                    if n_step == 1 and "more than 1 value per channel" in str(e):
                        raise ModelContractError(
                            f"step {state.step + 1} (epoch {epoch + 1}) has one window: the training split's "
                            f"{loader.n_windows:,} windows leave 1 after the batches of training.batch_size="
                            f"{cfg.batch_size}, and the model's BatchNorm cannot train on one ({e}); change "
                            "training.batch_size by one"
                        ) from e
                    raise
                state.step, state.epoch_step = state.step + 1, state.epoch_step + 1
                state.train_windows, windows_done = state.train_windows + n_step, windows_done + n_step
                if cb.after_step is not None:
                    cb.after_step(state.step, found is not None)
                saver.poll()
                now = time.perf_counter()
                pace.add(n_step, now - fetch, fetched - fetch)
                progress.span.add(n_step, now - fetch, fetched - fetch)
                if step.ddp is not None:  # one all-reduce: the global batch's loss, and any rank's stop, save or budget
                    due, spent = saver.due(), time.monotonic() >= stop_at
                    step_loss, part, stopping, due, spent = _agree_step(plan, stop, step_loss, part, due, spent, log)
                loss_sum += part
                if cb.on_step is not None and state.step % plan.step_every == 0:
                    check_loss(step_loss.float(), state.step, model)  # read back here anyway: no extra sync
                    cb.on_step(state.step, {"train_loss": step_loss.item(), "lr": lr})
                progress.maybe(epoch, now, step_loss)
                if state.epoch_step % report_every == 0 and state.epoch_step < plan.steps_per_epoch:
                    wps = windows_done / max(time.perf_counter() - t0, 1e-9)
                    log(
                        f"  epoch {epoch + 1}/{cfg.epochs} step {state.epoch_step}/{plan.steps_per_epoch} "
                        f"loss {step_loss.item():.4f} lr {lr:.2e} {wps:,.0f} windows/s"
                    )
                if step.ddp is None:  # one process: a signal (one during the callbacks too), the clock, the budget
                    stopping, due, spent = stop.signal_name, saver.due(), time.monotonic() >= stop_at
                due = due or bool(cfg.checkpoint_every_steps and state.step % cfg.checkpoint_every_steps == 0)
                # the epoch's last step is checkpointed after validation instead
                if state.epoch_step < plan.steps_per_epoch and (stopping or due or spent):
                    state.train_loss_sum = loss_sum.item()
                    last = saver.save(state, is_best=False)
                    # one process: a signal during the save stops at it too (several: at the next step, together)
                    stopping = stopping if step.ddp is not None else stop.signal_name
                    if stopping:
                        raise Preempted(last, stopping)
                    if spent:
                        raise opt.deadline.exceeded(last)

            batches.close()  # a streamed split's shards in flight leave the cache to the validation split
            train_seconds = time.perf_counter() - t0
            state.train_loss_sum = loss_sum.item()
            entry, metrics, is_best = {}, {}, False
            if ranks.is_main:  # several processes: rank 0 validates (the others wait at the checkpoint's collective)
                metrics = evaluate(
                    model, val, cfg.batch_size, device, step.ctx, plan.data, cfg.loss_weights, opt.ranking
                )
                check_selected(metrics, plan.select_by, opt.ranking, val)
                entry = _entry(epoch, state, metrics, lr, t0, train_seconds, windows_done, pace)
                is_best = state.mark(entry, plan.select_by, plan.direction)
            state.epoch_complete = True
            step.epoch_end()  # the model's own scheduler, when it steps once an epoch: before the epoch's checkpoint
            if cb.on_epoch is not None:
                cb.on_epoch(epoch, {k: v for k, v in entry.items() if k not in ("epoch", "step")})
            if cb.prune is not None and epoch < cfg.epochs - 1 and cb.prune(epoch, entry):
                state.pruned_epoch = epoch + 1  # decided before the checkpoint, which keeps the decision
            last = saver.save(state, is_best=is_best)
            if ranks.is_main:
                log(_epoch_line(entry, metrics, cfg, plan.select_by, is_best, pace))
            progress.epoch_end(epoch, step_loss)
            if state.pruned_epoch is not None:
                break
            stopping, spent = _any_rank(plan, stop.signal_name, epoch < cfg.epochs - 1 and time.monotonic() >= stop_at)
            if stopping:
                raise Preempted(last, stopping)
            if spent:
                raise opt.deadline.exceeded(last)

    if step.ddp is not None:  # every rank hands back rank 0's account of the run
        state.load_state_dict(*from_main((state.state_dict(), state.history)))
    if state.best_epoch is not None:
        log(
            f"best checkpoint: epoch {state.best_epoch}/{cfg.epochs} by {plan.select_by} ({state.best_score:.4f}), "
            f"{state.best_checkpoint}"
        )
    return _result(state, ckpt_dir, plan.device.type, plan.precision, plan.select_by, found and found[0], run_meta)


# ---------------------------------------------------------------- the named places fit() goes through


@dataclass
class _Plan:
    """What a run is, fixed before its first step."""

    spec: dict
    data: DataSpec
    training: dict  # the training settings as checkpoints store them, the selection resolved
    select_by: str
    direction: str | None
    known: dict
    windows: dict
    device: torch.device
    precision: str
    ranks: World
    steps_per_epoch: int
    total_steps: int
    step_every: int


def _plan(train: SplitData, val: SplitData, model_spec: dict, cfg: TrainingConfig, task, opt: FitOptions) -> _Plan:
    spec = plain(model_spec, "model_spec")
    data = data_spec_of(spec)
    check_cache_room(train, val, cfg.shuffle_shards)  # before the checks below read every shard
    check_inputs(train, val, data, task)
    device = pick_device(cfg.device)
    ranks = world()  # several processes (DDP, trainer/distributed.py): rank 0 alone logs, reports and checkpoints
    if ranks.distributed:
        check_batch_size(cfg.batch_size, ranks.size)
    select_by, direction, known = selection(cfg, data, opt.ranking)
    # stored resolved: a resume compares the selection meant (unset and val_loss are the same one)
    training = {**cfg.model_dump(mode="json"), "select_by": select_by, "select_direction": direction}
    per_epoch, total = planned_steps(train.n_windows, cfg)
    return _Plan(
        spec,
        data,
        training,
        select_by,
        direction,
        known,
        {"train": train.n_windows, "validation": val.n_windows},
        device,
        pick_precision(cfg.precision, device),
        ranks,
        per_epoch,
        total,
        opt.step_every if opt.step_every is not None else max(1, total // STEP_POINTS),
    )


def loader_threads(cfg: TrainingConfig, device: torch.device) -> int:
    """training.num_workers, or its default: 2 on a CUDA device (whose steps, captured, outrun one thread's
    gathering), 0 elsewhere (the CPU's cores train)."""
    if cfg.num_workers is not None:
        return cfg.num_workers
    return 2 if device.type == "cuda" else 0


def _loader(train: SplitData, cfg: TrainingConfig, plan: _Plan) -> WindowLoader:
    return WindowLoader(
        train,
        cfg.batch_size,
        cfg.seed,
        shuffle=True,
        pin_memory=plan.device.type == "cuda",
        num_workers=loader_threads(cfg, plan.device),
        shuffle_shards=cfg.shuffle_shards,
        rank=plan.ranks.rank,
        world_size=plan.ranks.size,
    )


def _start_line(plan: _Plan, cfg: TrainingConfig, model, train: SplitData) -> str:
    name = plan.spec["model"].get("entrypoint") or plan.spec["model"]["family"]
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # a frozen backbone's are not
    count = f"{total:,} parameters" + (f", {trained:,} of them trained" if trained != total else "")
    return (
        f"training {name} ({count}) on {plan.device.type}/"
        f"{plan.precision}: {cfg.epochs} epochs x {plan.steps_per_epoch} steps, {train.n_windows:,} train windows; "
        f"the best checkpoint is the epoch with the {'highest' if plan.direction == 'maximize' else 'lowest'} "
        f"{plan.select_by} (training.select_by)"
    )


def _entry(
    epoch: int, state: TrainState, metrics: dict, lr: float, t0: float, train_s: float, windows: int, pace
) -> dict:
    """An epoch's history entry: its validation metrics, and how fast it trained and validated."""
    now = time.perf_counter()
    return {
        "epoch": epoch,
        "step": state.step,
        "train_loss": state.train_loss_sum / max(1, state.train_windows),
        **metrics,
        "lr": lr,
        "windows_per_s": windows / max(train_s, 1e-9),
        "seconds": now - t0,
        "val_seconds": now - t0 - train_s,
        "data_wait_fraction": pace.wait_fraction,
    }


def _result(
    state: TrainState, ckpt_dir: str, device: str, precision: str, select_by: str, resumed_from, run_meta, best=None
) -> FitResult:
    """The run's result, from the loop's state (`best`: the best checkpoint's URI, when not the state's)."""
    return FitResult(
        best_checkpoint=best or join(ckpt_dir, state.best_checkpoint),
        last_checkpoint=join(ckpt_dir, state.last_checkpoint),
        best_score=state.best_score,
        history=state.history,
        steps=state.step,
        device=device,
        precision=precision,
        resumed_from=resumed_from,
        run_meta=run_meta,
        best_epoch=state.best_epoch,
        select_by=select_by,
        pruned_epoch=state.pruned_epoch,
    )


def _notes(plan: _Plan, cfg: TrainingConfig, log) -> None:
    """Settings sized for another data set: said at the start, with the numbers."""
    if cfg.warmup_steps >= plan.total_steps:
        log(
            f"note: training.warmup_steps={cfg.warmup_steps} is not below this run's {plan.total_steps} optimizer "
            f"steps ({cfg.epochs} epochs x {plan.steps_per_epoch}): the learning rate never reaches "
            f"training.lr={cfg.lr:g}; lower warmup_steps"
        )
    # counted over the whole run (step % every), not within an epoch: a setting above an epoch's steps still
    # checkpoints mid-epoch later on
    if cfg.checkpoint_every_steps >= plan.total_steps and plan.total_steps > 0:
        log(
            f"note: training.checkpoint_every_steps={cfg.checkpoint_every_steps} is not below this run's "
            f"{plan.total_steps} optimizer steps: checkpoints are taken at epoch ends only"
        )


def _find_checkpoint(ckpt_dir: str, resume: bool, ranks: World, log) -> tuple[str, dict] | None:
    """The checkpoint to resume from: the newest complete one rank 0 finds (None: a fresh run)."""
    removed = remove_temp_files(ckpt_dir)  # left by a process killed inside a write
    if removed:
        log(f"deleted {len(removed)} temp file(s) of an interrupted checkpoint write in {ckpt_dir}")
    found = latest_checkpoint(ckpt_dir) if resume else None
    if ranks.distributed:  # every rank resumes from the checkpoint rank 0 found (or none)
        found = from_main(found)
    if not resume:
        cleared = clear_checkpoints(ckpt_dir)
        if cleared:
            log(f"resume=False: deleted {len(cleared)} old checkpoint file(s) in {ckpt_dir}")
    return found


def _finished(
    found, ckpt_dir: str, cfg: TrainingConfig, select_by: str, run_meta: dict, log, pruning: bool
) -> FitResult | None:
    """A run whose last epoch is checkpointed (or, while `pruning`, one its pruner stopped): its result, without
    training."""
    side = found[1]
    if side.get("best_checkpoint") and not point_best(ckpt_dir, side["best_checkpoint"]):
        log(f"warning: the best checkpoint {side['best_checkpoint']} in {ckpt_dir} is missing or damaged")
    pruned = side.get("pruned_epoch") if pruning else None
    if not (side["epoch_complete"] and (side["epoch"] == cfg.epochs - 1 or pruned)):
        return None
    log(f"training already {'pruned' if pruned else 'finished'} in {ckpt_dir} ({side['step']} steps): its result")
    state, best = TrainState(), best_checkpoint(ckpt_dir)
    state.load_state_dict({**side, "last_checkpoint": side["file"], "pruned_epoch": pruned}, side["history"])
    run_meta = {**side.get("run_meta", {}), **run_meta}
    return _result(state, ckpt_dir, side["device"], side["precision"], select_by, found[0], run_meta, best and best[0])


def _build_model(plan: _Plan, cfg: TrainingConfig, opt: FitOptions, fresh: bool, run_meta: dict, log, train):
    """(the model, seeded, its lazy layers shaped by the first windows, with a parent's weights and frozen
    parameters where asked, on the run's device; run_meta with the parent's account)."""
    seed_all(cfg.seed)
    model = model_from_spec(plan.spec)
    if is_lazy_model(model):  # shapes from the first windows of the split, whatever the shuffle
        first = train.batch(np.arange(min(2, len(train)))).to(plan.device)  # as a step takes it
        materialize(model, first.cont, first.cat, plan.device)
        train.release()  # a streamed split's shard, opened for those windows
        log(f"{type(model).__name__}: lazy layers shaped by a forward of the first batch")
    if not plan.data.targets and own_hook(model, "loss") is None:
        raise ModelContractError(
            f"{type(model).__name__} has no loss(outputs, cont, cat, targets) and the data has no target "
            "(data.targets is empty): define the model's own loss, or declare a target"
        )
    check_selection(model, plan.select_by, plan.direction, plan.known)
    if cfg.loss_weights and own_hook(model, "loss") is not None:  # the weights are the default loss's
        raise ModelContractError(
            f"training.loss_weights {dict(cfg.loss_weights)} weighs the targets of the default loss, which "
            f"{type(model).__name__}.loss replaces (it is not given them): remove training.loss_weights, or weigh the "
            "targets in your loss (model.params can carry the weights)"
        )
    matched = None
    if opt.init_weights is not None and fresh:  # a resumed run has its own weights in its checkpoint
        matched = load_matching(model, opt.init_weights, opt.init_source)
        run_meta = {**run_meta, "init_from": {"source": opt.init_source, **matched}}

        def listed(names: list[str]) -> str:
            return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "") or "none"

        # a tensor of another shape than the parent's (a wider layer, a longer window) starts at random: a warning
        other = "; the skipped ones have another shape than the parent's and start at random"
        log(
            ("warning: " if matched["skipped"] else "")
            + f"init_from {opt.init_source}: loaded {len(matched['loaded'])} tensor(s), {len(matched['new'])} new "
            f"({listed(matched['new'])}), {len(matched['skipped'])} skipped ({listed(matched['skipped'])})"
            + (other if matched["skipped"] else "")
        )
    own = [n for n, p in model.named_parameters() if not p.requires_grad]  # frozen by the model itself
    frozen, norms = freeze(model, list(cfg.freeze)) if cfg.freeze else ([], [])
    unloaded = sorted(set(frozen) - set(matched["loaded"])) if matched is not None and fresh else []
    if matched is not None and fresh and (random := sorted(set(own) - set(matched["loaded"]) - set(frozen))):
        # a model that freezes a part of itself (requires_grad_(False) in its __init__) for the parent's weights
        # to fill: those init_from did not fill stay at their random start (a frozen random layer may be meant)
        log(
            f"warning: {type(model).__name__} freezes {len(random)} parameter tensor(s) itself that init_from "
            f"{opt.init_source} did not load (new, or of another shape): {', '.join(random[:8])}"
            f"{', ...' if len(random) > 8 else ''}; they stay at their random start, never trained"
        )
    if unloaded:  # frozen at their random start: never trained, never loaded
        raise ModelContractError(
            f"training.freeze {list(cfg.freeze)} freezes {len(unloaded)} tensor(s) that init_from "
            f"{opt.init_source} did not load (new, or of another shape): {', '.join(unloaded[:8])}"
            f"{', ...' if len(unloaded) > 8 else ''}; they would stay at their random start. Freeze only what "
            "the parent gives (narrow training.freeze), or give them the parent's shapes"
        )
    if not any(p.requires_grad for p in model.parameters()):  # the first backward would say "does not require grad"
        what = (
            f"training.freeze {list(cfg.freeze)} freezes every one of its {len(frozen)} parameter tensor(s)"
            if frozen
            else "it has no trainable parameters"
            + (f" (it freezes its own {len(own)})" if own else " (nn.Parameter, or a layer such as nn.Linear)")
        )
        raise ModelContractError(
            f"{type(model).__name__}: nothing to train: {what}. Leave some parameters trainable (narrow "
            "training.freeze), or give the model a layer to train"
        )
    if frozen:
        kept = f"; {len(norms)} norm layer(s) kept in eval mode (running statistics as loaded)" if norms else ""
        log(f"training.freeze {list(cfg.freeze)}: {len(frozen)} parameter tensor(s) frozen{kept}")
    return model.to(plan.device), run_meta


def _resume(found, step: Step, loader: WindowLoader, state: TrainState, run_meta: dict, cfg, plan: _Plan, log) -> dict:
    """Everything the next step depends on, as the checkpoint saved it; the run_meta to keep."""
    ranks = plan.ranks
    try:
        ckpt = load_checkpoint(found[0])
    except FileNotFoundError:
        if ranks.is_main:
            raise
        raise ValueError(
            f"process {ranks.rank} cannot read {found[0]}, the checkpoint rank 0 resumes from: with "
            "compute.nodes > 1, storage.root must be storage every node reads (an object store, a shared volume)"
        ) from None
    step.load_state_dict(ckpt)
    loader.load_state_dict(ckpt["loader"])
    state.load_state_dict(ckpt["loop"], ckpt["history"])
    saved_size = found[1].get("world_size", 1)
    if saved_size == ranks.size:  # each rank's own RNGs (one process: rng_ranks is absent or [rng])
        set_rng_state((ckpt.get("rng_ranks") or [ckpt["rng"]])[ranks.rank])
    else:  # same position in the data; rank 0 continues the saved RNGs, the others start their own
        set_rng_state(ckpt["rng"])
        if ranks.rank:
            seed_rank(cfg.seed, ranks.rank, state.step)
        log(
            f"note: checkpoint was trained by {saved_size} process(es), resuming with {ranks.size}: same "
            "position in the data, same global batches, but not bit-identical to an uninterrupted run"
        )
    if (found[1]["device"], found[1]["precision"]) != (plan.device.type, plan.precision):
        log(
            f"note: checkpoint was trained on {found[1]['device']}/{found[1]['precision']}, resuming on "
            f"{plan.device.type}/{plan.precision}: the result will not be bit-identical to an uninterrupted run"
        )
    log(
        f"resuming from {found[0]}: epoch {state.epoch + 1}, step {state.step}, "
        f"{loader.offset}/{loader.n_windows} windows of the epoch done"
    )
    return {**ckpt["run_meta"], **run_meta}


class _Progress:
    """Where the run is, for `on_progress`: cheap to build, and built only when it is due."""

    def __init__(self, on_progress, seconds: float, plan: _Plan, cfg, state: TrainState, first_epoch: int):
        self.on_progress, self.seconds, self.plan, self.cfg, self.state = on_progress, seconds, plan, cfg, state
        self.started, self.steps_before, self.span, self.last_loss = time.perf_counter(), state.step, Pace(), None
        self.last = self.started
        if on_progress is not None:
            self.report(first_epoch, None)

    def maybe(self, epoch: int, now: float, step_loss: torch.Tensor) -> None:
        if self.on_progress is not None and now - self.last >= self.seconds:
            self.report(epoch, step_loss)

    def epoch_end(self, epoch: int, step_loss: torch.Tensor | None) -> None:
        if self.on_progress is not None:
            self.report(epoch, step_loss)

    def report(self, epoch: int, step_loss: torch.Tensor | None) -> None:
        if step_loss is not None:
            self.last_loss = step_loss.item()
        state, total = self.state, self.plan.total_steps
        validated = state.history[-1] if state.history else {}
        done = state.step - self.steps_before
        self.on_progress(
            {
                "step": state.step,
                "total_steps": total,
                "epoch": epoch + 1,
                "epochs": self.cfg.epochs,
                "train_loss": self.last_loss,
                "windows_per_s": self.span.windows_per_s,
                "data_wait_fraction": self.span.wait_fraction,
                "seconds_left": (time.perf_counter() - self.started) / done * (total - state.step) if done else None,
                "validated_epoch": validated["epoch"] + 1 if validated else None,
                "val_loss": validated.get("val_loss"),
                "select_by": self.plan.select_by,
                "selected": validated.get(self.plan.select_by),
                "best_epoch": state.best_epoch,
                "best_score": state.best_score,
            }
        )
        self.span = Pace()
        self.last = time.perf_counter()


def _agree_step(plan: _Plan, stop, step_loss, part, due: bool, spent: bool, log):
    """Several processes, one all-reduce a step: the global batch's loss and loss sum, and any rank's stop, save
    or budget for all."""
    stopping, spent, loss, summed, n_due = _any_rank(plan, stop.signal_name, spent, step_loss.item(), part.item(), due)
    if stopping == ANOTHER_PROCESS:
        log("another process was stopped: saving a checkpoint at this step, then stopping")
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64, device=plan.device)
    return as_tensor(loss), as_tensor(summed), stopping, n_due > 0, spent


def _any_rank(plan: _Plan, stopping: str | None, spent: bool, *values: float) -> tuple:
    """A stop or a spent budget of any rank, for all (every rank stops, or none), then each of `values` summed over
    the ranks: one all-reduce."""
    if not plan.ranks.distributed:
        return stopping, spent, *values
    *sums, n_stop, n_spent = all_sum([*values, float(bool(stopping)), float(spent)], plan.device)
    return stopping or (ANOTHER_PROCESS if n_stop else None), n_spent > 0, *sums


def _epoch_line(entry: dict, metrics: dict, cfg: TrainingConfig, select_by: str, is_best: bool, pace: Pace) -> str:
    scores = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "val_loss")
    waited = f", data wait {pace.wait_fraction:.0%} of step time" if pace.wait_fraction is not None else ""
    return (
        f"epoch {entry['epoch'] + 1}/{cfg.epochs}: train_loss {entry['train_loss']:.4f} val_loss "
        f"{entry['val_loss']:.4f}{' ' + scores if scores else ''} lr {entry['lr']:.2e} "
        f"{entry['windows_per_s']:,.0f} windows/s {entry['seconds']:.1f}s{waited}"
        f"{f' (best {select_by})' if is_best else ''}"
    )
