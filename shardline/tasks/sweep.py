"""Sweep steps: a local trial's training in a process of its own, the sweep's parent MLflow run, its
report (the comparison picture, the Prefect artifact) and the registered version's sweep tags.

Each trial trains through the pipeline's own cached train step (`TRAIN_CACHE`, its run folder): a
finished trial is a cache hit, an interrupted one resumes from its checkpoints. Locally, its training
flow runs in a child process (`train_in_child`): torch's thread count is the process's, so trials that
share the machine each get their share of its cores, and a trial that crashes takes only its process.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import TerminationSignal
from prefect.futures import as_completed
from prefect.logging import get_run_logger

from shardline.core import storage
from shardline.core.config import PipelineConfig
from shardline.core.cost.ledger import add_up, read_ledger, summarize
from shardline.core.failures import (
    QUIET_ENV,
    InfrastructureFailure,
    console_is_quiet,
    failed_on_infrastructure,
    retry_on_infrastructure,
)
from shardline.core.parent_watch import PARENT_ENV
from shardline.core.secrets import redact_text, redacted_errors
from shardline.core.study import PRUNERS, TRIAL_ATTR, Pruning, ask_planned, distributions, from_choice
from shardline.core.sweep import Plan, SweepError, Trial, best_of, data_key, is_cross_validation, plot_sweep
from shardline.core.tracking.tracker import Tracker, run_page, tracking_uri
from shardline.core.version import spawning_this_shardline
from shardline.runs import links
from shardline.runs.result import Parent, Registered, TrainResult
from shardline.tasks.caching import cached
from shardline.tasks.train import (
    TRAIN_CACHE,
    TrainingRunFailed,
    run_tag,
    tagged_flow_runs,
    train_step,
    watch_training_run,
)

SWEEP_TAG = "shardline.sweep"  # on the trials' MLflow runs and the registered version: the parent run's id


# what a trial's process needs, imported once by multiprocessing's fork server (~7 s of CPU: torch and its compiler
# front end, which every optimizer loads, MLflow, Prefect, the training): each trial is then a fork of it, not an
# interpreter that imports them again
TRIAL_PRELOAD = ["shardline.tasks.trial_group", "shardline.flows.train", "torch._dynamo", "mlflow"]
_starting = threading.Lock()
_interrupted = threading.Event()  # Ctrl-C in this process's sweep: no trial is started or retried after it
_stopped_by = signal.SIGINT  # ...and the signal it was: passed on to a trial that starts after it
_trials: set[int] = set()  # the pids of the trial processes running (`interrupt_trials` passes Ctrl-C on to them)
_trials_lock = threading.Lock()


class _ForkServerStarts:
    """`multiprocessing` as `prefect.flow_engine.run_flow_in_subprocess` sees it while a trial starts: the spawn
    context it asks for is the fork server's (Prefect passes the flow, its context and its environment to the
    process as arguments, which a fork server's child takes as a spawned one does)."""

    def __init__(self, context):
        self.context = context

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)

    def get_context(self, method: str | None = None):
        return self.context


@contextmanager
def forked_from_preloaded():
    """Prefect's flow-in-a-subprocess, started from the fork server within the block (where there is one: not on
    Windows). Trials start from several threads at once: one at a time here, for the moment each takes to start."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        yield
        return
    import prefect.flow_engine as engine

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(TRIAL_PRELOAD)
    with _starting, spawning_this_shardline():
        spawning = engine.multiprocessing
        engine.multiprocessing = _ForkServerStarts(context)
        try:
            yield
        finally:
            engine.multiprocessing = spawning


def train_in_child(
    flow,
    manifest_uri: str,
    config: PipelineConfig,
    folder: str,
    mlflow_tags: dict[str, str] | None = None,
    cpu_threads: int | None = None,
    parent: Parent | None = None,
    pruning: Pruning | None = None,
) -> TrainResult:
    """Run the training flow `flow` in a child process on this machine and return its result (from the run
    folder's `result.json`, as a dispatched run's). The child reaches this process's Prefect API (the
    ephemeral one included), its flow run is tagged like a dispatched one (`shardline-run:<folder>`), it
    sets torch to `cpu_threads` threads, and it stops at a checkpoint if this process dies."""
    from prefect import tags
    from prefect.client.orchestration import get_client
    from prefect.context import serialize_context
    from prefect.flow_engine import run_flow_in_subprocess
    from prefect.settings import PREFECT_API_URL, temporary_settings

    log = get_run_logger()
    tag = run_tag(folder)
    with get_client(sync_client=True) as client:
        api = str(client.api_url).rstrip("/")  # an ephemeral API's too: the child must not start its own
    parameters = {
        "manifest_uri": manifest_uri,
        "config": config,
        "run_folder": folder,
        "mlflow_tags": mlflow_tags,
        "cpu_threads": cpu_threads,
        "parent": parent,
        "pruning": pruning,
        "watched": True,  # an infrastructure failure is raised as InfrastructureFailure: the trial is retried
    }
    earlier = {r.id for r in tagged_flow_runs(tag)}  # an interrupted attempt's: not this child's
    with temporary_settings(updates={PREFECT_API_URL: api}), tags("shardline", tag), forked_from_preloaded():
        if _interrupted.is_set():
            raise TrainingRunFailed(f"training run {folder} was not started: the sweep was interrupted (Ctrl-C)")
        process = run_flow_in_subprocess(
            flow,
            parameters=parameters,
            context=serialize_context(),
            # the trial's console says what this one's says, as this one says it (without --verbose: no traceback
            # of a preemption, a budget stop or the user's error)
            env={PARENT_ENV: str(os.getpid()), QUIET_ENV: "1" if console_is_quiet() else "0"},
        )
    log.info("train: %s in child process %d (%s torch threads)", folder, process.pid, cpu_threads or "default")
    with _trials_lock:
        _trials.add(process.pid)
        if _interrupted.is_set():  # Ctrl-C while it started
            os.kill(process.pid, _stopped_by)
    try:
        process.join()
    finally:
        with _trials_lock:
            _trials.discard(process.pid)
    flow_run = next((r for r in tagged_flow_runs(tag) if r.id not in earlier), None)
    if flow_run is not None and (flow_run.state is None or not flow_run.state.is_final()):
        flow_run = watch_training_run(flow_run.id, folder, 30, 1)  # its last state may still be on its way
    state = flow_run.state if flow_run is not None else None
    runs = [{"name": flow_run.name, "id": str(flow_run.id), "state": state.name if state else None}] if flow_run else []
    if process.exitcode == 0 and state is not None and state.is_completed():
        return TrainResult.read(folder, runs)
    why = state.message if state is not None and state.message else f"its process exited with status {process.exitcode}"
    if state is not None and failed_on_infrastructure(state):  # retried by the trial's step (max_restarts)
        raise InfrastructureFailure(f"training run {flow_run.name} failed on its infrastructure: {why}")
    raise TrainingRunFailed(
        f"training run {flow_run.name if flow_run else folder} ended "
        f"{state.name if state else 'without a flow run'}: {why}"
    )


def trial_tags(parent_run_id: str | None, sweep_id: str, trial: Trial) -> dict[str, str]:
    """The tags of a trial's MLflow run: its parent (MLflow nests it under the sweep's run), the trial and
    its overrides."""
    tags = {"shardline.sweep_id": sweep_id, **sweep_tags(parent_run_id, trial)}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    return tags


def sweep_tags(parent_run_id: str | None, trial: Trial) -> dict[str, str]:
    """What a trial's run and the version registered from it say of the sweep: the trial, its overrides, the
    sweep's parent run."""
    tags = {links.TRIAL_TAG: trial.id, "shardline.sweep.overrides": json.dumps(trial.overrides)}
    if parent_run_id:
        tags[SWEEP_TAG] = parent_run_id
    return tags


@contextmanager
def parent_run(plan: Plan, folder: str) -> Iterator[Tracker]:
    """The sweep's parent MLflow run for a block, created once and continued by every rerun of the same sweep (its
    journal is in the sweep's folder, as a training run's is in its run folder): ended KILLED (Ctrl-C) or FAILED
    when the block raises (`finish_parent_run` ends it when the sweep is done)."""
    base = plan.base
    tracker = Tracker(base.mlflow, base.storage.root, run_dir=folder)
    tracker.start(
        run_name=f"{base.name} · sweep {plan.id[:8]}",
        tags={"shardline.sweep_id": plan.id, "shardline.sweep.keys": ", ".join(plan.keys)},
    )
    if not tracker.resumed:
        tracker.log_params(
            {
                "sweep.mode": plan.mode,
                "sweep.trials": plan.size or len(plan.trials),
                "sweep.seed": plan.seed,
                **({"sweep.pruner": plan.pruner} if plan.pruner else {}),
                **{f"sweep.space.{k}": json.dumps(v) for k, v in plan.describe_space().items()},
            }
        )
    tracker.set_tags(links.mlflow_tags())
    if tracker.run_id is None:
        get_run_logger().warning("sweep: MLflow did not answer; the trials' runs are not nested under a parent run")
    try:
        yield tracker
    except BaseException as e:
        stopped = isinstance(e, (KeyboardInterrupt, TerminationSignal))  # Ctrl-C, a notice: resumed by a rerun
        tracker.end("KILLED" if stopped else "FAILED", wait=min(5.0, tracker.flush_s))
        raise


def check_pruning(plan: Plan, prune: str | None) -> None:
    """A pruner needs what it compares: trials of whole epochs in one process each, and no cross-validation."""
    if prune is None:
        return
    if prune not in PRUNERS:
        raise SweepError(f"--prune {prune!r}: choose one of {', '.join(PRUNERS)}")
    if is_cross_validation(plan.space):
        raise SweepError("--prune with --folds: a setting is judged by its mean over the folds; prune a plain sweep")
    several = [c for c in [plan.base, *plan.configs] if c.compute.processes_per_node * c.compute.nodes > 1]
    if several:
        raise SweepError(
            "--prune: a pruned trial trains in one process (compute.processes_per_node: 1, compute.nodes: 1); "
            f"this sweep trains in {several[0].compute.processes_per_node * several[0].compute.nodes}"
        )
    if all(c.training.epochs < 2 for c in [plan.base, *plan.configs]):  # a trial is judged at an epoch before its last
        raise SweepError(f"--prune {prune}: every trial trains 1 epoch; a trial is pruned at an epoch before its last: "
                         "nothing would be. Train 2 epochs or more (training.epochs) or leave out --prune")  # fmt: skip


class SweepStudy:
    """The sweep's Optuna study (core/study.py) as the trials see it: each trial is one of the study's, found again
    by its id when the sweep runs again; its outcome is told when it ends (complete with its score, pruned, failed);
    with a pruner, each trial's training reports its epochs and may be stopped (`Pruning`)."""

    def __init__(self, plan: Plan, folder: str, pruner: str | None, raw: dict):
        from shardline.core.study import make_pruner, make_sampler, open_study

        self.plan, self.pruner, self.raw = plan, pruner, raw
        self.journal = storage.join(folder, "optuna")
        base = plan.base.training
        self.select_by, self.direction = base.select_by, base.select_direction
        self.epochs = max([base.epochs, *(c.training.epochs for c in plan.configs)])
        self.study = open_study(
            self.journal,
            plan.id,
            self.direction,
            make_pruner(pruner, self.epochs),
            make_sampler(plan.mode, plan.seed or 0),
        )
        self.numbers: dict[str, int] = {}  # trial id -> Optuna trial number

    def _known(self) -> dict[str, object]:
        return {
            t.user_attrs[TRIAL_ATTR]: t for t in self.study.get_trials(deepcopy=False) if TRIAL_ATTR in t.user_attrs
        }

    def pruning(self, trial: Trial) -> Pruning | None:
        """The trial's place in the study (found again, or asked now), and what its training needs to be pruned."""
        if trial.id not in self.numbers:
            known = self._known().get(trial.id)
            if known is None:
                known = ask_planned(self.study, self.plan.space, trial.overrides)
                known.set_user_attr(TRIAL_ATTR, trial.id)
                known.set_user_attr("overrides", json.dumps(trial.overrides))
            self.numbers[trial.id] = known.number
        if self.pruner is None:
            return None
        return Pruning(
            journal=self.journal,
            study=self.plan.id,
            trial=self.numbers[trial.id],
            pruner=self.pruner,
            epochs=self.epochs,
            select_by=self.select_by,
        )

    def proposed(self):
        """tpe: the study's trials so far (a finished one comes from the train cache, an unfinished one resumes),
        then Optuna's next proposals, asked one at a time as trials finish, up to the sweep's size. Each is
        (trial, its config). A proposal the config refuses, or one that trains the model of an earlier trial, is
        told to Optuna as failed, named in the log, and another is asked (at most 10x the sweep's size in all)."""
        from optuna.trial import TrialState

        from shardline.core.study import make_sampler
        from shardline.core.sweep import what_is_trained

        log = get_run_logger()
        dists = distributions(self.plan.space)
        known = sorted(self._known().values(), key=lambda t: t.number)
        for t in known:
            yield self._trial(t.user_attrs[TRIAL_ATTR], t.number, t.params)
        asked_before = len(self.study.get_trials(deepcopy=False))
        if asked_before:  # a sampler seeded as the first run's would draw its first proposals again
            self.study.sampler = make_sampler(self.plan.mode, (self.plan.seed or 0) + asked_before)
        trained = {what_is_trained(c): t for t, c in zip(self.plan.trials, self.plan.configs)}
        wanted, asks = self.plan.size - len(known), 10 * self.plan.size - asked_before
        while wanted > 0 and asks > 0:
            asks -= 1
            asked = self.study.ask(dists)
            trial_id = f"t{len(self.plan.trials) + 1:0{len(str(self.plan.size))}d}"
            try:
                trial, config = self._trial(trial_id, asked.number, asked.params, keep=False)
            except SweepError as e:
                self.study.tell(asked, state=TrialState.FAIL)
                log.warning("sweep: Optuna's proposal is refused, told to Optuna as failed: %s", e)
                continue
            same = trained.get(what_is_trained(config))
            if same is not None:
                asked.set_user_attr("shardline.same_as", same.id)
                self.study.tell(asked, state=TrialState.FAIL)
                log.warning("sweep: Optuna proposed %s again (%s trains that model); asking for another", trial.label,
                            same.id)  # fmt: skip
                continue
            asked.set_user_attr(TRIAL_ATTR, trial_id)
            self.plan.trials.append(trial)
            self.plan.configs.append(config)
            trained[what_is_trained(config)] = trial
            wanted -= 1
            yield trial, config
        if wanted > 0:
            log.warning(
                "sweep: Optuna proposed no new trial the config takes (%d proposals in all); the sweep ends with %d "
                "trial(s) of --tpe %d (a space this small: sweep it as a grid)",
                len(self.study.get_trials(deepcopy=False)),
                len(self.plan.trials),
                self.plan.size,
            )

    def _trial(self, trial_id: str, number: int, params: dict, keep: bool = True) -> tuple[Trial, PipelineConfig]:
        """The trial Optuna's `params` stand for (a range's drawn value kept to 6 significant digits, as a random
        sweep's), with its config; kept in the plan unless `keep` is False."""
        from shardline.core.sweep import trial_config

        def value(key: str, spec) -> object:
            if isinstance(spec, list):
                return from_choice(spec, params[key])
            return params[key] if spec.int_ else float(f"{params[key]:.6g}")

        trial = Trial(trial_id, {k: value(k, v) for k, v in self.plan.space.items() if k in params})
        self.numbers[trial.id] = number
        config = trial_config(self.raw, trial)
        if keep:
            self.plan.trials.append(trial)
            self.plan.configs.append(config)
        return trial, config

    def tell(self, trial: Trial, row: dict, result: TrainResult | None = None) -> None:
        """A trial's outcome, told once: its score (complete), pruned, or failed. A trial that reported no epoch to
        this study (its training came from the cache: another sweep's, or a smaller --tpe's) gets its epochs'
        values from its `result` first, so that the pruner judges later trials against the whole history."""
        import optuna
        from optuna.trial import TrialState

        if row.get("state") == "budget":  # stays running in the study: the rerun that raises the limit resumes it
            return
        number = self.numbers[trial.id]  # given when the trial was submitted (`pruning`)
        frozen = next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)
        if result is not None and frozen.state == TrialState.RUNNING and not frozen.intermediate_values:
            asked = optuna.trial.Trial(self.study, frozen._trial_id)
            for epoch, entry in enumerate(result.history, start=1):
                value = entry.get(result.select_by)
                if isinstance(value, int | float) and math.isfinite(value):
                    asked.report(float(value), epoch)
        if row.get("state") == "pruned":
            self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
        elif row.get("score") is not None:
            self.study.tell(number, row["score"], skip_if_finished=True)
        else:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


def train_trials(
    plan: Plan,
    data: dict,
    parent_run_id: str | None,
    at_once: int,
    train_here,
    study: SweepStudy | None = None,
    pairs=None,
) -> list[tuple]:
    """Wire the trials' training (inside a flow run), through the cached train step: `at_once` in flight, the next
    taken only once one finishes (and its outcome is told to the `study`); `data` maps `data_key(config)` to
    (snapshot, manifest URI, checksum). `pairs`: (trial, config) pairs as they come (tpe: Optuna's proposals;
    cross-validation's final retrain); default: the plan's. Returns each trial's (row, training result) in the
    trials' order (`trial_outcome`)."""
    futures, running, order, before = {}, [], [], {}
    pairs = iter(pairs if pairs is not None else list(zip(plan.trials, plan.configs)))

    def ended(future) -> None:
        running.remove(future)
        if study is not None:
            trial, config = next(pair for pair in order if futures[pair[0].id] is future)
            study.tell(trial, *trial_outcome(trial, config, future))

    _interrupted.clear()
    try:
        while True:
            while len(running) >= at_once:
                ended(_next_done(running))
            pair = next(pairs, None)
            if pair is None:
                break
            trial, config = pair
            order.append(pair)
            if isinstance(data[data_key(config)], Exception):  # its data did not encode (flows/sweep.py): failed
                futures[trial.id] = data[data_key(config)]
                if study is not None:
                    study.pruning(trial)  # its place in the study, told failed
                    study.tell(trial, *trial_outcome(trial, config, futures[trial.id]))
                continue
            _, manifest_uri, manifest_hash = data[data_key(config)]
            step = cached(train_step, TRAIN_CACHE, config.storage.root).with_options(
                retries=config.training.max_restarts,
                retry_delay_seconds=5,
                retry_condition_fn=_retry_unless_interrupted,
                task_run_name=f"train {trial.id}",
            )
            tags = trial_tags(parent_run_id, plan.id, trial)
            before[trial.id] = _outcome_of(_run_folder(config, manifest_uri))  # a finished run found: not "ran"
            pruning = study.pruning(trial) if study is not None else None
            futures[trial.id] = step.submit(
                manifest_uri, manifest_hash, config, train_here, mlflow_tags=tags, pruning=pruning
            )
            running.append(futures[trial.id])
        while running:
            ended(_next_done(running))
    except (KeyboardInterrupt, TerminationSignal) as stop:  # Ctrl-C, or a notice (a spot machine reclaimed)
        interrupt_trials(signal.SIGTERM if isinstance(stop, TerminationSignal) else signal.SIGINT)
        raise
    outcomes = [trial_outcome(trial, config, futures[trial.id]) for trial, config in order]
    for (row, result), (trial, config) in zip(outcomes, order, strict=True):
        if row.get("error") and not isinstance(futures[trial.id], Exception):  # a failed or budget-stopped trial
            # paid for what it trained: its run folder's ledger
            folder = _run_folder(config, data[data_key(config)][1])
            attempts = read_ledger(folder)["attempts"] if folder else []
            row["cost"] = summarize(attempts) if attempts else None
            if attempts and attempts[-1].get("outcome") == "budget":  # stopped at its budget, resumable: no fault
                row["state"] = "budget"
        elif row["state"] == "ran" and result is not None and before.get(trial.id) == _outcome_of(result.run_dir):
            row["state"] = "cached"  # its run folder held this result already (another sweep's): nothing trained
    return outcomes


def _next_done(running: list):
    """The next of the `running` futures to finish, waited for a second at a time: the kernel may deliver Ctrl-C's
    SIGINT to another of this process's threads, and the main thread raises KeyboardInterrupt only once it runs
    again (with Prefect's `as_completed`, which waits without a limit, a sweep went on until a trial ended)."""
    inner = [getattr(f, "wrapped_future", None) for f in running]
    if not all(isinstance(w, cf.Future) for w in inner):
        return next(as_completed(running))
    while True:
        done, _ = cf.wait(inner, timeout=1.0, return_when=cf.FIRST_COMPLETED)
        if done:
            future = running[inner.index(next(iter(done)))]
            future.wait()
            return future


def interrupt_trials(signum: int = signal.SIGINT) -> None:
    """Ctrl-C (or a notice, SIGTERM) in the sweep: no trial starts or is retried after it, and the trials running, in
    their fork server's process group (`shardline.tasks.trial_group`), get the signal the sweep got: each stops at a
    checkpoint (one still starting, at its first step), and the same command again resumes them."""
    global _stopped_by
    with _trials_lock:
        _interrupted.set()
        _stopped_by = signum
        for pid in _trials:
            try:
                os.kill(pid, signum)
            except OSError:  # it has just ended
                pass


def _retry_unless_interrupted(task, task_run, state) -> bool:
    return not _interrupted.is_set() and retry_on_infrastructure(task, task_run, state)


def _run_folder(config: PipelineConfig, manifest_uri: str) -> str | None:
    """The run folder of the training run of `config`, or None where it cannot be told."""
    from shardline.runs.training_run import load_manifest, run_dir

    try:
        return run_dir(config, load_manifest(manifest_uri, config))
    except Exception:  # noqa: BLE001 - a trial that fails before its run folder is chosen: said by its training
        return None


def _outcome_of(folder: str | None) -> tuple | None:
    """What a run folder's `result.json` says was trained (its steps and best checkpoint), or None."""
    from shardline.runs.result import RESULT_FILE

    try:
        done = json.loads(storage.read_text(storage.join(folder, RESULT_FILE))) if folder else None
    except Exception:  # noqa: BLE001 - none yet (or unreadable): nothing found
        return None
    return (done.get("steps"), done.get("best_sha256")) if done else None


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict], best: dict | None, metric: str, pages: dict[str, str]) -> str:
    """The trials as a markdown table: overrides, score, state, MLflow run; the best marked."""
    lines = [f"| trial | overrides | {metric} | state | MLflow run |", "|---|---|---|---|---|"]
    for r in rows:
        score = "" if r.get("score") is None else f"{r['score']:.4g}"
        name = f"**{r['trial']}** (best)" if best is not None and r["trial"] == best["trial"] else r["trial"]
        run = r.get("mlflow_run_id") or ""
        if run and pages.get(run):
            run = f"[{run[:12]}]({pages[run]})"
        state = r["state"] if not r.get("error") else f"{r['state']}: {_cell(r['error'])[:300]}"
        overrides = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in r["overrides"].items())
        lines.append(f"| {name} | {overrides} | {score} | {state} | {run} |")
    return "\n".join(lines)


def cv_table(settings: list[dict], best: dict | None, metric: str) -> str:
    """A cross-validated sweep's settings as a markdown table: each fold's score, their mean and std."""
    folds = sorted({f for s in settings for f in s["scores"]}, key=int)
    lines = [
        f"| setting | overrides | {' | '.join(f'fold {f}' for f in folds)} | mean {metric} | std |",
        "|---" * (4 + len(folds)) + "|",
    ]
    for s in settings:
        name = f"**{s['trial']}** (best)" if best is not None and s["trial"] == best["trial"] else s["trial"]
        overrides = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in s["setting"].items())
        scores = " | ".join(f"{s['scores'][f]:.4g}" if f in s["scores"] else "failed" for f in folds)
        mean = "" if s["score"] is None else f"{s['score']:.4g}"
        std = "" if s["std"] is None else f"{s['std']:.4g}"
        lines.append(f"| {name} | {overrides} | {scores} | {mean} | {std} |")
    return "\n".join(lines)


@task(name="report-sweep")
@redacted_errors
def report_sweep(
    rows: list[dict],
    keys: list[str],
    metric: str,
    direction: str,
    folder: str,
    heading: str,
    pages: dict[str, str],
    settings: list[dict] | None = None,
    final: str = "",
) -> str:
    """Draw the comparison picture into the sweep's folder and list the trials in the `sweep` artifact;
    return the picture's URI."""
    best = best_of(rows)
    local = not storage.is_remote(folder)
    if local:
        plot = str(plot_sweep(rows, keys, metric, direction, Path(storage.local_path(folder)) / "comparison.png"))
    else:
        with tempfile.TemporaryDirectory(prefix="shardline-sweep-") as tmp:
            drawn = plot_sweep(rows, keys, metric, direction, Path(tmp) / "comparison.png")
            plot = storage.join(folder, "comparison.png")
            storage.write_bytes(plot, drawn.read_bytes())
    create_markdown_artifact(
        key="sweep",
        markdown=redact_text(
            f"## {heading}\n\n"
            + (
                f"### Cross-validation (selected by the mean)\n\n{cv_table(settings, best_of(settings), metric)}\n\n"
                f"{final}\n\n### Trials (one per setting and fold)\n\n"
                if settings
                else ""
            )
            + table(rows, best, metric, pages)
        ),
        description="the sweep's trials: overrides, validation score, state, MLflow run",
    )
    return plot


def finish_parent_run(
    tracker: Tracker,
    rows: list[dict],
    metric: str,
    plot: str,
    text: str,
    settings: list[dict] | None = None,
    best: dict | None = None,
) -> None:
    """Log the trials on the parent run (each trial's score at its trial number, once; the `best` score as
    `best/<metric>`, the value the runs table shows; the results as sweep.json; the failures as a tag; the
    picture) and end it: FINISHED unless every trial failed."""
    log = get_run_logger()
    key = f"trial/{metric}"
    logged = tracker.last_step(key)
    for i, r in enumerate(rows, start=1):
        if r.get("score") is not None and i > logged:
            tracker.log_metrics({key: r["score"]}, i)
    # MLflow's runs table shows a metric's last step: trial/<metric> there is the last trial's, not the best's
    if best is not None and best.get("score") is not None and tracker.last_step(f"best/{metric}") < len(rows):
        tracker.log_metrics({f"best/{metric}": best["score"]}, len(rows))
    failed = {r["trial"]: r["error"] for r in rows if r.get("error")}
    if settings:  # cross-validation: each setting's mean and std over the folds, at its setting number
        for i, st in enumerate(settings, start=1):
            if st["score"] is not None and i > tracker.last_step(f"setting/{metric}/mean"):
                tracker.log_metrics({f"setting/{metric}/mean": st["score"], f"setting/{metric}/std": st["std"]}, i)
    total = add_up([r.get("cost") for r in rows])  # a failed trial's too: what it trained was paid for
    if total is not None and tracker.last_step("cost/gpu_hours") < 0:  # the trials' training, all of it
        spend = {"cost/gpu_hours": total["gpu_hours"], "cost/gpu_hours_wasted": total["gpu_hours_wasted"]}
        if total["usd"] is not None:
            spend.update({"cost/usd": total["usd"], "cost/usd_wasted": total["usd_wasted"]})
        tracker.log_metrics(spend, 0)
    tracker.log_dict(
        {"metric": metric, "trials": rows, "cost": total, **({"settings": settings} if settings else {})}, "sweep.json"
    )
    tracker.set_tags(
        {
            "shardline.sweep.failed": json.dumps(failed)[:5000] if failed else "none",
            "mlflow.note.content": text,
        }
    )
    if tracker.run_id is not None:
        try:
            with tempfile.TemporaryDirectory(prefix="shardline-sweep-") as scratch:
                local = plot
                if storage.is_remote(plot):  # a local copy to log
                    local = str(Path(scratch) / "comparison.png")
                    Path(local).write_bytes(storage.read_bytes(plot))
                tracker.client.log_artifact(tracker.run_id, local, "sweep")
        except Exception as e:  # noqa: BLE001 - a picture is never worth a failed sweep
            log.warning("sweep: could not log the comparison picture on the parent run: %s", e)
    tracker.end("FAILED" if rows and len(failed) == len(rows) else "FINISHED")


def tag_version(config: PipelineConfig, registered: Registered, parent_run_id: str | None, trial: Trial) -> None:
    """Tag the registered version with the sweep that chose it and the winning trial's overrides."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(config.mlflow, config.storage.root))
    name, version = registered.model_name, str(registered.version)
    for k, v in sweep_tags(parent_run_id, trial).items():
        client.set_model_version_tag(name, version, k, v)


def parent_pages(tracker: Tracker, run_ids: list[str]) -> dict[str, str]:
    """The MLflow UI's page of the parent run and of each trial's run (by run id)."""
    try:
        experiment = tracker.client.get_run(tracker.run_id).info.experiment_id if tracker.run_id else None
    except Exception:  # noqa: BLE001 - an address, not a result
        return {}
    if experiment is None:
        return {}
    return {r: run_page(tracker.uri, experiment, r) for r in [tracker.run_id, *run_ids] if r}


CHILD_ERROR = "Flow run encountered an exception: "  # Prefect's words before a flow run's error, in its state


def trial_outcome(trial: Trial, config: PipelineConfig, future) -> tuple[dict, TrainResult | None]:
    """A trial's row (its overrides, the validation metric that picked its checkpoint, its best value and which
    way is better, as the trial's config says: `training.select_direction`; whether it trained, came from the
    cache or failed and why; its MLflow run) and its training result."""
    row = {"trial": trial.id, "overrides": trial.overrides, "score": None, "error": None}
    if isinstance(future, Exception):  # no training: the trial's data did not encode
        return {**row, "state": "failed", "error": redact_text(" ".join(str(future).split()))}, None
    future.wait()
    state = future.state
    if not state.is_completed():
        error = future.result(raise_on_failure=False)
        text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else state.message
        text = str(text).rsplit(CHILD_ERROR, 1)[-1]  # a trial's own error, not the wrappers around it
        text = " ".join(str(text).split())  # stopped at its budget: resumable, raising the limit finishes it
        row.update(state="budget" if text.startswith("BudgetExceeded: ") else "failed", error=redact_text(text))
        return row, None
    result = future.result()
    row.update(
        state="pruned" if result.pruned_epoch is not None else "cached" if state.name == "Cached" else "ran",
        pruned_epoch=result.pruned_epoch,
        metric=result.select_by,
        score=result.best_score,
        direction=config.training.select_direction,
        best_epoch=result.best_epoch,
        mlflow_run_id=result.mlflow_run_id,
        run_dir=result.run_dir,
        cost=result.cost,  # what its training cost (a cached trial: when it ran), an estimate
    )
    return row, result
