"""Sweeps: a search space, the trials it makes, each trial's config, and how trials are compared.

A trial is the base config with a few keys overridden (`{"training.lr": 0.01, "model.hidden": 64}`),
applied the way `--set` applies them and validated by the config's own validation, so a sweep can
set anything a config can, and a value the config refuses is said before any work, naming the trial
and the key. A search space maps dotted config keys to a list of values (a choice) or a range
(`{low, high, log, int}`); a grid takes every combination of the lists, a random sweep draws N
trials with a seeded generator (the same seed, the same trials). Plain Python: no Prefect, no MLflow.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardline.core.config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    key_problem,
    metric_directions,
    read_yaml,
    stable_hash,
    validate_config,
)
from shardline.core.config.load import inline_config, is_inline
from shardline.core.secrets import KEEP_SECRETS


class SweepError(ConfigError):
    """A sweep the user must fix (a key that is no config key, an empty grid, a bad range, a trial whose
    config is refused); the message names the trial or the key."""


class SweepFailed(RuntimeError):
    """Every trial of a sweep failed (or its cross-validation's final retrain did): the message lists each trial
    with its overrides and its error, a line each, and the command says it without a traceback."""


class Range(BaseModel):
    """A numeric range sampled uniformly, or log-uniformly (`log: true`), rounded for `int: true`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    low: float
    high: float
    log: bool = False
    int_: bool = Field(False, alias="int")

    @model_validator(mode="after")
    def _check(self) -> Range:
        if not self.low < self.high:
            raise ValueError(f"low={self.low:g} must be below high={self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0 (got low={self.low:g})")
        if self.int_ and math.ceil(self.low) > math.floor(self.high):
            raise ValueError(f"int: true, and no whole number lies between low={self.low:g} and high={self.high:g}")
        return self

    def sample(self, rng: random.Random) -> float | int:
        if self.log:
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        if self.int_:
            return int(min(max(round(value), math.ceil(self.low)), math.floor(self.high)))
        return float(f"{value:.6g}")  # a readable value: the same in the config, MLflow and the plot


Space = dict[str, list | Range]  # dotted config key -> the values to try (a choice) or a range


@dataclass(frozen=True)
class Trial:
    """One point of the space: `overrides` (dotted key -> value) applied to the base config."""

    id: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={_short(v)}" for k, v in self.overrides.items())


def _short(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


# ---------------------------------------------------------------- the space


def parse_space(raw: Any, origin: str = "the search space") -> Space:
    """A search space from its YAML mapping: each dotted config key to a list of values or a range."""
    if not isinstance(raw, dict) or not raw:
        raise SweepError(
            f"{origin}: expected a mapping of dotted config keys to a list of values or "
            "{low, high, log, int}, e.g. training.lr: {low: 1e-4, high: 1e-2, log: true}"
        )
    space: Space = {}
    for key, spec in raw.items():
        key = str(key)
        if isinstance(spec, Range):
            space[key] = spec
        elif isinstance(spec, list):
            if not spec:
                raise SweepError(f"{origin}: {key} lists no value; give at least one")
            space[key] = list(spec)
        elif isinstance(spec, dict):
            try:
                space[key] = Range.model_validate(spec)
            except ValidationError as e:
                raise SweepError(f"{origin}: {key}: {_range_problem(e)}") from None
        else:
            raise SweepError(
                f"{origin}: {key}: {spec!r} is neither a list of values nor a range {{low, high, log, int}}"
            )
    check_keys(list(space), origin)
    return space


def _range_problem(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) + " (a range is {low, high, log: true|false, int: true|false})"


def read_space(path: str | Path) -> Space:
    if isinstance(path, str) and is_inline(path):  # the space's YAML text (a deployment's parameter)
        try:
            return parse_space(yaml.safe_load(path), "the space given inline")
        except yaml.YAMLError:
            raise SweepError("the search space given inline is not valid YAML") from None
    path = Path(path)
    if not path.exists():
        raise SweepError(f"search space file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from None
    return parse_space(raw, str(path))


def parse_grid(items: list[str]) -> Space:
    """`--grid key=v1,v2` items as a space of choices (each value read as YAML, as `--set` reads it)."""
    space: Space = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SweepError(f"--grid '{item}': expected key.path=v1,v2,..., e.g. --grid training.lr=0.01,0.001")
        if key in space:
            raise SweepError(f"--grid {key} is given twice; list all its values in one --grid")
        parsed = [yaml.safe_load(v) for v in values.split(",") if v.strip()]
        if not parsed:
            raise SweepError(f"--grid {key}: the grid is empty; list at least one value: --grid {key}=v1,v2")
        space[key] = parsed
    check_keys(list(space), "--grid")
    return space


# where the trials run and are recorded is the sweep's: one storage root, one MLflow experiment, one pool
SHARED_SECTIONS = ("storage", "mlflow", "compute")


def check_keys(keys: list[str], origin: str) -> None:
    problems = [p for k in keys if (p := key_problem(k))]
    problems += [
        f"'{k}' is the sweep's, not a trial's: every trial shares {k.split('.')[0]}.* (set it in the config)"
        for k in keys
        if k.split(".")[0] in SHARED_SECTIONS
    ]
    problems += [
        f"'{k}' is the sweep's, not a trial's: it is what the trials are compared by (set it in the config)"
        for k in keys
        if k == "training.select_by"
    ]
    if problems:
        raise SweepError(f"{origin}: " + "; ".join(problems))


# ---------------------------------------------------------------- trials


def grid_trials(space: Space) -> list[Trial]:
    """Every combination of the space's lists, the first key varying slowest (a range cannot be a grid)."""
    ranges = [k for k, v in space.items() if isinstance(v, Range)]
    if ranges:
        raise SweepError(
            f"{', '.join(ranges)}: a range has no grid; sample it with --random N, or list its values instead"
        )
    return _trials([dict(zip(space, values)) for values in itertools.product(*space.values())])


def random_trials(space: Space, n: int, seed: int = 0) -> list[Trial]:
    """`n` points drawn from the space by a generator seeded with `seed` (the same seed, the same trials);
    a point drawn twice is one trial."""
    if n < 1:
        raise SweepError(f"--random {n}: draw at least one trial")
    rng = random.Random(seed)
    drawn = [{k: (rng.choice(v) if isinstance(v, list) else v.sample(rng)) for k, v in space.items()} for _ in range(n)]
    return _trials(drawn)


def _trials(points: list[dict]) -> list[Trial]:
    """A trial per distinct point, in order: t1, t2, ... (zero-padded to the count: t01 of 10)."""
    unique: dict[str, dict] = {}
    for p in points:
        unique.setdefault(json.dumps(p, sort_keys=True, default=str), p)
    width = len(str(len(unique)))
    return [Trial(f"t{i + 1:0{width}d}", p) for i, p in enumerate(unique.values())]


@dataclass
class Plan:
    """A sweep, checked: its trials, each trial's validated config, and its identity (the same base config
    and trials, the same sweep: its parent MLflow run and folder are found again by a rerun)."""

    base: PipelineConfig
    space: Space
    mode: str  # "grid", "random" or "tpe"
    seed: int | None
    trials: list[Trial]
    configs: list[PipelineConfig]

    size: int = 0  # tpe: how many trials Optuna proposes (they are asked one by one, not planned)
    pruner: str | None = None  # --prune: another sweep than the same trials unpruned (its own study and parent)
    data: str | None = None  # the raw files' fingerprint, once ingested: new files are another sweep

    @property
    def id(self) -> str:
        pruned = {"pruner": self.pruner} if self.pruner else {}
        if self.data:  # trials on other data: not scored against this study's, nor in its parent run
            pruned["data"] = self.data
        if self.mode == "tpe":  # its trials are Optuna's answers: the sweep is its space, seed and size
            tpe = [self.describe_space(), self.seed, self.size]
            return stable_hash({"base": self.base_identity(), "tpe": tpe, **pruned})[:16]
        trials = [[t.id, t.overrides] for t in self.trials]
        return stable_hash({"base": self.base_identity(), "trials": trials, **pruned})[:16]

    def base_identity(self) -> str:
        """The base config, less what a training resumes across (where or how fast it trains, its budget): the
        same sweep after `training.max_cost` is raised, as the docs say, with the same parent run and study."""
        base = self.base.model_dump(mode="json")
        for key in self.base.training.RESUMABLE_CHANGES:
            base["training"].pop(key, None)
        return stable_hash(base)

    @property
    def keys(self) -> list[str]:
        return list(self.space)

    def describe_space(self) -> dict:
        return {k: (v.model_dump(by_alias=True) if isinstance(v, Range) else v) for k, v in self.space.items()}


def raw_config(config: PipelineConfig | dict | str) -> dict:
    """The mapping trials are made from: a YAML file's (after `extends`), a dict as given, or a validated
    config's, secrets kept (it stays in this process) and without the defaults its validation derived from
    the targets (the promotion metric), so a trial with other targets derives its own."""
    if isinstance(config, str) and is_inline(config):  # the config's YAML text (a deployment's parameter)
        return inline_config(config)
    if isinstance(config, str | Path):
        return read_yaml(Path(config))
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    raw = config.model_dump(mode="json", context=KEEP_SECRETS)
    metrics = metric_directions(config.data.target_list)
    first = next(iter(metrics))
    if (config.mlflow.promotion_metric, config.mlflow.promotion_direction) == (first, metrics[first]):
        raw["mlflow"].pop("promotion_metric", None)
        raw["mlflow"].pop("promotion_direction", None)
    return raw


def trial_config(raw: dict, trial: Trial) -> PipelineConfig:
    """The base config's raw mapping with the trial's overrides, validated; an error names the trial."""
    items = [f"{k}={json.dumps(v)}" for k, v in trial.overrides.items()]  # as `--set` items: YAML reads JSON as given
    try:
        return validate_config(apply_overrides(raw, items), f"of trial {trial.id} ({trial.label})")
    except ConfigError as e:
        raise SweepError(str(e)) from None


def plan_sweep(raw: dict, space: Space, trials: int | None = None, seed: int = 0, sampler: str | None = None) -> Plan:
    """Check a sweep before any work: the base config (`raw`, after `extends` and `--set`), the space, and
    every trial's config. `trials`: draw that many at random; None: the grid. `sampler="tpe"`: `trials` proposed
    one by one by Optuna's TPE sampler from the finished ones (each checked as it is proposed)."""
    base = validate_config(raw, "(the sweep's base config)")
    _check_comparable(base, space)
    if sampler == "tpe":
        if trials is None:
            raise SweepError("--tpe N: say how many trials Optuna proposes")
        if FOLD_KEY in space:
            raise SweepError(f"a tpe sweep cannot cross-validate ({FOLD_KEY} in the space, or --folds): sweep a grid")
        check_keys(list(space), "the search space")
        _check_ranges_take_a_value(raw, space)
        points = math.prod(len(v) for v in space.values()) if all(isinstance(v, list) for v in space.values()) else 0
        if points and trials > points:  # Optuna would propose the same few again and again (38 warnings for 2)
            raise SweepError(
                f"--tpe {trials}: the search space's lists hold {points} trial(s) in all; sweep them as a grid "
                "(--space without --tpe), or give a range ({low, high}) to search"
            )
        return Plan(base, space, "tpe", seed, [], [], size=trials)
    if trials is not None and FOLD_KEY in space:
        # a random draw would pick one fold per setting, not every fold: no mean over the folds to compare
        raise SweepError(
            f"a random sweep cannot cross-validate ({FOLD_KEY} in the space, or --folds): each drawn setting "
            f"would train on one random fold; sweep a grid with --folds, or leave {FOLD_KEY} out"
        )
    chosen = grid_trials(space) if trials is None else random_trials(space, trials, seed)
    configs = [trial_config(raw, t) for t in chosen]
    _check_distinct(chosen, configs)
    return Plan(base, space, "grid" if trials is None else "random", None if trials is None else seed, chosen, configs)


# a text model's validation scores, each counted over the tokenizer's own tokens
TOKEN_SCORES = ("val_loss", "val_perplexity", "val_accuracy")
OTHER_ROWS = ("split", "source", "target", "targets")  # data.* keys whose trials are validated on other rows or targets


def _check_comparable(base: PipelineConfig, space: Space) -> None:
    """Trials of text data with other tokenizers, compared by a score over tokens, are refused before any work: each
    tokenizer cuts the same text into other tokens (a larger vocabulary, fewer and rarer ones), so their loss,
    perplexity and next-token accuracy measure different things (the sweep picked the tokenizer whose tokens were
    easiest to guess, and the champion gate then refused to compare the same two models)."""
    metric = base.training.select_by or "val_loss"
    rows = [k for k in space if k.split(".")[:2] in [["data", r] for r in OTHER_ROWS]]
    if rows:  # each trial scored on other rows, or on another target: the luckiest split won, not the best model
        raise SweepError(
            f"the search space varies {', '.join(rows)}: each trial would be validated on other rows (or another "
            f"target), so their {metric} do not compare and the sweep would pick the trial of the easiest "
            "validation rows, not the best model. Keep the data's split, source and target one for the whole sweep "
            "(sweep the model, the training, the window), and for a score that does not hang on one split, "
            "cross-validate: k-fold data (data.split.method: kfold) with --folds"
        )
    if base.data.split.method == "kfold" and base.training.fold is None and FOLD_KEY not in space:
        # each trial validated on a fold it trains on: the trial that fits its own rows best won
        raise SweepError(
            f"k-fold data with {FOLD_KEY}: null validates each trial on rows it also trains on (in-sample), so "
            f"the sweep would pick the trial that fits its training rows best, not the best model. Add --folds "
            f"(each setting cross-validated on every fold, compared by the mean), or set {FOLD_KEY}: 0 to validate "
            "every trial on one held-out fold"
        )
    varied = [k for k in space if k == "data.tokenizer" or k.startswith("data.tokenizer.")]
    if varied and base.data.features.text and metric in TOKEN_SCORES:
        raise SweepError(
            f"the search space varies {', '.join(varied)}, and the trials are compared by {metric}, a score over "
            "tokens: trials of different tokenizers count different tokens, so their "
            f"{', '.join(TOKEN_SCORES)} do not compare. Keep the tokenizer one for the whole sweep (sweep the "
            "model and training settings), or compare by a score of your model's own that counts no tokens "
            "(training.select_by: val_<name>, from its metrics())"
        )


def _check_ranges_take_a_value(raw: dict, space: Space) -> None:
    """A range the config refuses at its ends and its middle (`model.hidden: {low: -5, high: 0}`) would have Optuna
    propose nothing the config takes: said before any work, with the config's own words."""
    for key, spec in space.items():
        if not isinstance(spec, Range):
            continue
        middle = math.sqrt(spec.low * spec.high) if spec.log else (spec.low + spec.high) / 2
        probes = [spec.low, middle, spec.high]
        probes = (
            [int(min(max(round(v), math.ceil(spec.low)), math.floor(spec.high))) for v in probes]
            if spec.int_
            else probes
        )
        refused = []
        for value in dict.fromkeys(probes):
            try:
                trial_config(raw, Trial("proposal", {key: value}))
                break
            except SweepError as e:
                refused.append(e)
        else:
            tried = ", ".join(f"{v:g}" for v in dict.fromkeys(probes))
            raise SweepError(f"{key}: the config takes no value of its range (tried {tried}): {refused[0]}")


def what_is_trained(config: PipelineConfig) -> str:
    """What decides a trial's model, from its config: its data settings, its model and its training
    settings (the settings that only change where or how fast it trains are left out)."""
    # id_columns: carried to the predictions, never a feature
    kept = {"on_bad_file", "group_mb", "files_per_group", "encode_workers", "id_columns"}
    data = config.data.model_dump(mode="json", exclude=kept)
    model = config.model.model_dump(mode="json", exclude={"code_dir"})
    if config.model.entrypoint is None and config.model.family == "gpt":  # params.d_model wins over hidden, ...
        model = {k: v for k, v in model.items() if k not in ("hidden", "layers", "heads", "dropout", "params")}
        model["gpt"] = config.model.gpt_params()
    training = config.training.model_dump(mode="json", exclude=set(config.training.RESUMABLE_CHANGES))
    return stable_hash([data, model, training])


def _check_distinct(trials: list[Trial], configs: list[PipelineConfig]) -> None:
    """Two trials that train the same model (they differ only in where or how fast it trains, or in how a value is
    written) would be one training run: said before any work, with the keys that made them."""
    seen: dict[str, tuple[Trial, dict]] = {}
    for trial, config in zip(trials, configs):
        key, values = what_is_trained(config), config.model_dump(mode="json")
        if key in seen:
            first, first_values = seen[key]
            # as written (16 and 16.0 are equal in Python, and were said as no key at all)
            differ = [k for k in trial.overrides if repr(first.overrides.get(k)) != repr(trial.overrides[k])]
            if all(_at(first_values, k) == _at(values, k) for k in differ):  # the config reads both as one value
                said = ", ".join(f"{k}={first.overrides[k]!r} and {trial.overrides[k]!r}" for k in differ)
                text = any(isinstance(t.overrides[k], str) for t in (first, trial) for k in differ)
                raise SweepError(
                    f"trials {first.id} and {trial.id} are one trial: {said} are the same value to the config"
                    + (" (YAML reads 1e-2 as text: write 0.01 or 1.0e-2)" if text else "")
                )
            said = f"trials {first.id} ({first.label}) and {trial.id} ({trial.label}) train the same model: "
            if "training.precision" in differ:  # it changes the numbers, so "only where or how fast" was untrue
                raise SweepError(
                    said + "training.precision is a setting a run resumes across (a run started in bf16 on a GPU "
                    "resumes in fp32 on a CPU), so it is not part of what a run is: trials that differ only in it are "
                    "one run. To compare precisions, train each with `shardline run CONFIG --set "
                    "training.precision=VALUE --force train`"
                )
            raise SweepError(
                said + f"{', '.join(differ) or 'their settings'} {'does' if len(differ) == 1 else 'do'} not change "
                "what is trained (only where or how fast, what the predictions carry, or a value another setting "
                "overrides: model.params.d_model wins over model.hidden). Sweep over settings that change the "
                "model, the data or the training"
            )
        seen[key] = (trial, values)


def _at(values: dict, key: str):
    for part in key.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def data_key(config: PipelineConfig) -> str:
    """Trials with the same data settings (and the same starting model, which may bring its encoding) share
    one ingest and one encode."""
    return stable_hash([config.data.model_dump(mode="json"), config.training.init_from])


# ---------------------------------------------------------------- comparing trials


def best_of(rows: list[dict]) -> dict | None:
    """The row of the best finished trial by its score (`score`, `direction`), or None when none finished; a
    trial its pruner stopped only when every trial was. Ties go to the earlier trial."""
    scored = [r for r in rows if r.get("score") is not None]
    done = [r for r in scored if r.get("state") != "pruned"] or scored  # a pruned trial's score is of fewer epochs
    if not done:
        return None
    sign = -1 if done[0]["direction"] == "maximize" else 1
    return min(done, key=lambda r: (sign * r["score"], rows.index(r)))


def cpu_share(at_once: int) -> int:
    """Torch threads of each of `at_once` trials sharing this machine: its cores split between them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, at_once))


# ---------------------------------------------------------------- the comparison picture


def plot_sweep(rows: list[dict], keys: list[str], metric: str, direction: str, path: str | Path) -> Path:
    """`sweep_figure`, written atomically to `path`."""
    from shardline.core.metrics.report import _save_atomic

    return _save_atomic(sweep_figure(rows, keys, metric, direction), path)


def _scores(ax, xs: list, rows: list[dict]) -> None:
    """The trials' scores at `xs`: a filled point for a trial that trained all its epochs, a hollow one for a
    trial its pruner stopped (a score of fewer epochs), with a legend entry for those."""
    pruned = [r.get("state") == "pruned" for r in rows]
    whole = [(x, r["score"]) for x, r, p in zip(xs, rows, pruned) if not p]
    if whole:
        ax.scatter(*zip(*whole), color="#1f77b4", zorder=3)
    if any(pruned):
        cut = [(x, r["score"]) for x, r, p in zip(xs, rows, pruned) if p]
        ax.scatter(*zip(*cut), facecolors="none", edgecolors="#7f7f7f", zorder=3, label="pruned (fewer epochs)")


def sweep_figure(rows: list[dict], keys: list[str], metric: str, direction: str):
    """The score of every trial (the best one highlighted, a pruned one hollow, a failed one marked), then the
    score against each swept setting."""
    from matplotlib.ticker import NullFormatter

    from shardline.core.metrics.report import _new_figure

    panels = 1 + len(keys)
    cols = min(panels, 3)
    nrows = -(-panels // cols)
    fig = _new_figure(4.6 * cols, 3.4 * nrows)
    best = best_of(rows)
    ids = [r["trial"] for r in rows]
    done = [r for r in rows if r.get("score") is not None]
    ax = fig.add_subplot(nrows, cols, 1)
    xs = range(len(rows))
    _scores(ax, [i for i, r in zip(xs, rows) if r in done], done)
    if best is not None:
        ax.scatter(
            [rows.index(best)], [best["score"]], color="#2ca02c", s=90, zorder=4, label=f"best ({best['trial']})"
        )
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7)
    for i, r in enumerate(rows):
        if r.get("score") is None:  # failed: a red cross on the axis
            ax.scatter([i], [0.0], marker="x", color="#d62728", zorder=3, transform=ax.get_xaxis_transform())
            ax.annotate(
                r.get("state") if r.get("state") == "budget" else "failed",
                (i, 0.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 8),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                color="#d62728",
            )
    ax.set_xticks(list(xs), ids, rotation=45 if len(rows) > 8 else 0, fontsize=8)
    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_title(f"{metric} by trial ({'higher' if direction == 'maximize' else 'lower'} is better)", fontsize=9)
    ax.set_ylabel(metric, fontsize=8)
    ax.grid(alpha=0.3)
    for n, key in enumerate(keys, start=2):
        ax = fig.add_subplot(nrows, cols, n)
        values = [r["overrides"].get(key) for r in done]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        if numeric:
            xs = values
        else:
            labels = list(dict.fromkeys(_short(v) for v in values))
            xs = [labels.index(_short(v)) for v in values]
            ax.set_xticks(range(len(labels)), labels, fontsize=8)
        _scores(ax, xs, done)
        if best is not None and best in done:
            i = done.index(best)
            ax.scatter([xs[i]], [best["score"]], color="#2ca02c", s=90, zorder=4, label=f"best ({best['trial']})")
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
        if numeric and len(set(values)) > 1 and min(values) > 0 and max(values) / min(values) >= 10:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # over a decade or two they ran into each other
        ax.set_xlabel(key, fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- k-fold cross-validation

FOLD_KEY = "training.fold"


def with_folds(space: Space, base: PipelineConfig) -> Space:
    """The space with every fold of the base config's k-fold data as its last (fastest varying) key, so each
    setting of the other keys is trained on every fold (`shardline sweep --folds`)."""
    split = base.data.split
    if split.method != "kfold":
        raise SweepError(
            f"--folds cross-validates over the folds of k-fold data: the config's data.split.method is "
            f"'{split.method}'; set data.split: {{method: kfold, folds: K, test: 0.2}}"
        )
    if FOLD_KEY in space:
        raise SweepError(f"--folds sweeps {FOLD_KEY} itself; leave it out of the grid or the space")
    return {**space, FOLD_KEY: list(range(split.folds))}


def is_cross_validation(space: Space) -> bool:
    return FOLD_KEY in space


def cross_validate(rows: list[dict]) -> list[dict]:
    """The trials of a cross-validated sweep grouped by setting (their overrides but the fold), in the order
    they first appear: each setting's score per fold, and their mean and standard deviation (population,
    ddof 0, over the folds); a setting with a failed fold has no mean and is never chosen."""
    import numpy as np

    settings: dict[str, dict] = {}
    for r in rows:
        setting = {k: v for k, v in r["overrides"].items() if k != FOLD_KEY}
        key = json.dumps(setting, sort_keys=True, default=str)
        s = settings.setdefault(
            key, {"setting": setting, "trials": [], "scores": {}, "score": None, "std": None, "failed": []}
        )
        s["trials"].append(r["trial"])
        if r.get("score") is None:
            s["failed"].append(r["trial"])
        else:
            s["scores"][str(r["overrides"].get(FOLD_KEY))] = r["score"]
            s.update(metric=r["metric"], direction=r["direction"])
    out = []
    for i, s in enumerate(settings.values(), start=1):
        s["trial"] = f"s{i}"  # the setting's name in the report
        s["overrides"] = s["setting"]
        if s["scores"] and not s["failed"]:
            values = np.array(list(s["scores"].values()), dtype=np.float64)
            s["score"], s["std"] = float(values.mean()), float(values.std())
        out.append(s)
    return out
