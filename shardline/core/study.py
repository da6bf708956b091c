"""A sweep's Optuna study: its sampler, its pruner, and its journal in the storage root.

Optuna is the search engine (ask-and-tell: the sweep asks for a trial, trains it, tells the outcome) and decides
pruning; Shardline only keeps the study where every machine of the team finds it: Optuna's `JournalStorage` on a
backend that appends to the storage root (a folder of numbered entries, each written only if absent: a local file
system's hard link, S3's conditional put), so several processes and machines append to one study without a server
or a lock. Running the same sweep again opens the same study: its finished trials are kept, never repeated.

A trial that trains reports its selection metric once per epoch (`Pruning.callback`, in the training's process) and
asks the pruner whether to go on; a trial resumed after a preemption reports the same values for the same epochs
(a step already reported is left as it was), so the pruner decides as it would have.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from shardline.core import storage
from shardline.core.lease import create_exclusive

PRUNERS = ("median", "hyperband")
TRIAL_ATTR = "shardline.trial"  # the sweep's own name of an Optuna trial (t01, ...), in its user attributes
PRUNED_TAG = "shardline.sweep.pruned_at_epoch"  # on a pruned trial's MLflow run: the epoch it stopped after


class StorageJournal:
    """Optuna's journal backend (`optuna.storages.journal.BaseJournalBackend`) on the storage root: each append is
    one entry `<n>.json` created only if absent; a writer that loses a number takes the next. Entries never change
    once written, so a reader keeps those it read and reads only the new ones."""

    def __init__(self, folder: str):
        self.folder = folder
        self._read: dict[str, list[dict]] = {}

    def _entries(self) -> list[str]:
        return sorted(n for n in storage.names(self.folder) if n.endswith(".json") and n[:-5].isdigit())

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        logs: list[dict] = []
        for name in self._entries():
            if name not in self._read:
                self._read[name] = json.loads(storage.read_text(storage.join(self.folder, name)))
            logs.extend(self._read[name])
        return logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = json.dumps(logs).encode()
        n = len(self._entries())
        while not create_exclusive(storage.join(self.folder, f"{n:09d}.json"), data):
            n += 1


@functools.cache
def _backend_class() -> type:
    """`StorageJournal` as Optuna's backend type, made once (optuna is imported only by what uses a study)."""
    from optuna.storages.journal import BaseJournalBackend

    return type("StorageJournalBackend", (StorageJournal, BaseJournalBackend), {})


class Pruning(BaseModel):
    """What a trial's training needs to report to its study and hear the pruner: handed to the training (a flow
    parameter) with the trial's config."""

    model_config = ConfigDict(frozen=True)

    journal: str  # the study's journal folder in the storage root
    study: str
    trial: int  # Optuna's trial number
    pruner: str  # one of PRUNERS
    epochs: int  # the most epochs a trial trains (Hyperband's largest resource)
    select_by: str  # the validation metric reported each epoch

    def callback(self, log: Callable[[str], None]) -> Callable[[int, dict], bool]:
        """`(epoch, the epoch's validation entry) -> stop here?`: reports the entry's `select_by` at step epoch + 1
        and asks the pruner."""
        import optuna

        study = open_study(self.journal, self.study, None, make_pruner(self.pruner, self.epochs))
        frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == self.trial)
        trial = optuna.trial.Trial(study, frozen._trial_id)
        # a resumed trial's epochs reported before it stopped: trained again to the same value, not reported again
        # (Optuna ignores it, with a UserWarning in the user's console)
        reported = set(frozen.intermediate_values)

        def prune(epoch: int, entry: dict) -> bool:
            value = entry.get(self.select_by)
            if not isinstance(value, int | float) or not math.isfinite(value) or frozen.state.is_finished():
                return False  # a trial told failed at its budget by an earlier version: Optuna takes no report
            if epoch + 1 not in reported:
                trial.report(float(value), epoch + 1)
            if trial.should_prune():
                log(f"pruned at epoch {epoch + 1} by the sweep's {self.pruner} pruner ({self.select_by} {value:.4g})")
                return True
            return False

        return prune


def make_pruner(name: str | None, epochs: int):
    """Optuna's pruner by name, over a trial's epochs: `median` (stop a trial whose value at an epoch is worse than
    the median of the other trials' at that epoch, once one epoch is in), `hyperband` (successive halving in
    brackets, from one epoch to the last one a decision can save: `epochs` - 1, the last a trial reports; keeping a
    third at each rung); None: no pruning. The name was checked against PRUNERS (`tasks.sweep.check_pruning`)."""
    import optuna

    if name is None:
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(1, epochs - 1), reduction_factor=3)


def make_sampler(name: str, seed: int):
    """The sampler of a sweep: `tpe` (seeded) proposes each trial from the finished ones. The grid and random
    trials are planned by Shardline (the same trials as before Optuna) and asked without a search space, so
    their sampler draws nothing."""
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def open_study(journal: str, name: str, direction: str | None, pruner=None, sampler=None):
    """The study `name` in the journal folder `journal`, created when it is not there yet (`direction`: minimize
    or maximize; None: it must exist)."""
    import optuna
    from optuna.storages import JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    journal_storage = JournalStorage(_backend_class()(journal))
    if direction is None:
        return optuna.load_study(study_name=name, storage=journal_storage, pruner=pruner, sampler=sampler)
    return optuna.create_study(
        study_name=name,
        storage=journal_storage,
        direction=direction,
        pruner=pruner,
        sampler=sampler,
        load_if_exists=True,
    )


def _choice(value: Any) -> Any:
    """A choice as Optuna's categorical distribution holds it: a list or a mapping as its JSON text."""
    return value if value is None or isinstance(value, int | float | str | bool) else json.dumps(value)


def from_choice(values: list, chosen: Any) -> Any:
    """The value of `values` that Optuna's `chosen` stands for (the inverse of `_choice`)."""
    return next((v for v in values if _choice(v) == chosen), chosen)


def distributions(space: dict) -> dict:
    """Optuna's distribution of each key of a search space (core/sweep.py's `Space`): a list is a choice, a range
    a float or int range, log-scaled where it says."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out = {}
    for key, values in space.items():
        if isinstance(values, list):
            out[key] = CategoricalDistribution([_choice(v) for v in values])
        elif values.int_:
            out[key] = IntDistribution(math.ceil(values.low), math.floor(values.high), log=values.log)
        else:
            out[key] = FloatDistribution(values.low, values.high, log=values.log)
    return out


def planned_params(space: dict, overrides: dict) -> tuple[dict, dict]:
    """A planned trial's values (a grid's or a random sweep's) as Optuna's params, and distributions that hold
    them: its study trial then carries the values it trains, as Optuna's own views read them (`trials_dataframe`,
    the parameter importances). A drawn value rounded just past its range's end widens that trial's range to it."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    params, held = {}, {}
    for key, dist in distributions(space).items():
        if key not in overrides:
            continue
        value = _choice(overrides[key])
        if isinstance(dist, CategoricalDistribution):
            if value not in dist.choices:
                continue
        elif isinstance(value, bool) or not isinstance(
            value, int if isinstance(dist, IntDistribution) else int | float
        ):
            continue
        elif not dist.low <= value <= dist.high:
            dist = type(dist)(min(dist.low, value), max(dist.high, value), log=dist.log)
        params[key], held[key] = value, dist
    return params, held


def ask_planned(study, space: dict, overrides: dict):
    """A study trial for a planned trial (a grid's, a random sweep's), holding its values as Optuna's params
    (`planned_params`). A waiting trial left by a sweep killed between the two calls here, holding other values,
    is told failed."""
    from optuna.trial import TrialState

    params, dists = planned_params(space, overrides)
    if not params:
        return study.ask()
    study.enqueue_trial(params, skip_if_exists=False)
    for _ in range(64):
        asked = study.ask(dists)
        if asked.params == params:
            return asked
        study.tell(asked, state=TrialState.FAIL)
    return study.ask()
