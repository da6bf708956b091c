"""The names of the metrics a run reports (test, validation, ranking), each with its direction, and the check
of the metric a run selects its best epoch or registered model by."""

from __future__ import annotations

from shardline.core.config.data import TEXT_TARGET, Target

CLASSIFICATION_METRICS = {
    "accuracy": "maximize",
    "top5_accuracy": "maximize",
    "log_loss": "minimize",
    "macro_f1": "maximize",
}
REGRESSION_METRICS = {"mae": "minimize", "rmse": "minimize", "r2": "maximize"}
SELF_SUPERVISED_METRICS = {"loss": "minimize"}  # no target: the model's own loss on the test split
# text (data.features.text): the next token's loss over the target tokens, its perplexity (exp of that mean;
# the unigram baseline's is `perplexity_baseline`), next-token accuracy; a generation target also scores its
# greedy generations (exact match, token F1)
TEXT_METRICS = {"perplexity": "minimize", "loss": "minimize", "accuracy": "maximize"}
GENERATION_METRICS = {**TEXT_METRICS, "exact_match": "maximize", "token_f1": "maximize"}


RANKING_METRICS = ("ndcg", "map", "recall", "mrr")  # each at every k of evaluation.k; mrr uncut too


def ranking_metrics_of(ks) -> dict[str, str]:
    """The ranking metrics evaluation reports at cutoffs `ks` (shardline/core/metrics/ranking.py) -> the better
    direction (every one is maximised)."""
    names = [f"{m}@{k}" for m in RANKING_METRICS[:3] for k in ks] + ["mrr"] + [f"mrr@{k}" for k in ks]
    return dict.fromkeys(names, "maximize")


def metric_key(name: str) -> str:
    """An evaluation metric's name as MLflow takes it: MLflow names hold letters, digits, `_ - . / :` and
    spaces only, so a ranking metric's `@` is spelled out (`ndcg@10` is logged as `ndcg_at_10`); every
    other name is its own."""
    return name.replace("@", "_at_")


def validation_ranking_names(target: str, several: bool, ks) -> dict[str, str]:
    """Ranking data: each ranking metric at cutoffs `ks` (`ndcg@10`) -> its validation name, as the epoch
    history and MLflow name it (`val_ndcg_at_10`; `val_<target>/ndcg_at_10` with several targets)."""
    return {m: "val_" + metric_key(f"{target}/{m}" if several else m) for m in ranking_metrics_of(ks)}


def is_ranking_validation(name: str) -> bool:
    """Whether a validation metric's name is a ranking metric's (`val_ndcg_at_10`, `val_click/mrr`)."""
    return name.removeprefix("val_").rsplit("/", 1)[-1].partition("_at_")[0] in RANKING_METRICS


def metric_directions(targets: list[Target], ranking_ks=()) -> dict[str, str]:
    """Every evaluation metric of these targets -> the direction that is better, the default promotion
    metric first: bare names (`accuracy`) for one target, `target/metric` (`p1_action/accuracy`) for
    several, `loss` (the model's own) for none. Ranking data (`ranking_ks`: `evaluation.k` when
    `data.group_key` is set) adds the ranking metrics of the first target, the relevance (`ndcg@10`)."""
    if not targets:
        return dict(SELF_SUPERVISED_METRICS)
    out: dict[str, str] = {}
    for i, t in enumerate(targets):
        names = CLASSIFICATION_METRICS if t.task == "classification" else REGRESSION_METRICS
        first = "accuracy" if t.task == "classification" else "rmse"
        if t.task == "generation":
            names = TEXT_METRICS if t.column == TEXT_TARGET else GENERATION_METRICS
            first = "perplexity"
        if i == 0 and ranking_ks:
            names = {**names, **ranking_metrics_of(ranking_ks)}
        for m in sorted(names, key=lambda m: m != first):
            out[m if len(targets) == 1 else f"{t.column}/{m}"] = names[m]
    return out


# what the training loop validates each epoch, per target kind, and which way is better
VALIDATION_SCORES = {"classification": ("accuracy", "maximize"), "regression": ("mae", "minimize")}


def validation_name(target: str, kind: str, several: bool) -> str:
    """A target's validation score as the epoch history names it: `val_accuracy` or `val_mae` for one
    target, `val_<target>/accuracy` for several."""
    metric = VALIDATION_SCORES[kind][0]
    return f"val_{target}/{metric}" if several else f"val_{metric}"


def validation_metrics(targets: list[tuple[str, str]], ranking_ks=()) -> dict[str, str]:
    """The metrics the training loop validates for targets given as (column, kind), as the history names
    them -> the direction that is better: `val_loss`, then each target's score; ranking data (`ranking_ks`:
    `evaluation.k` when `data.group_key` is set) adds the first target's ranking metrics (`val_ndcg_at_10`,
    maximised). A model's own `metrics()` add `val_<name>` ones, known only once it runs."""
    out = {"val_loss": "minimize"}
    for name, kind in targets:
        if kind == "generation":  # text: the token-level perplexity and next-token accuracy
            out.update({"val_perplexity": "minimize", "val_accuracy": "maximize"})
            continue
        out[validation_name(name, kind, len(targets) > 1)] = VALIDATION_SCORES[kind][1]
    if targets and ranking_ks:
        out.update(
            dict.fromkeys(validation_ranking_names(targets[0][0], len(targets) > 1, ranking_ks).values(), "maximize")
        )
    return out


def resolve_selection(
    select_by: str | None,
    direction: str | None,
    known: dict[str, str],
    own_metrics: bool,
    own_directions: dict[str, str] | None = None,
) -> tuple[str, str]:
    """(metric, direction) that picks the best checkpoint: `select_by` (default val_loss) among the `known`
    validation metrics (-> direction), or, for a model with metrics of its own (`own_metrics`), a `val_<name>`
    with `direction` given or in `own_directions` (the promotion metric's). A name validation never gives, or
    a direction that contradicts the metric's, is an error naming training.select_by and what is allowed."""
    name = select_by or "val_loss"
    if name in known:
        if direction is not None and direction != known[name]:
            raise ValueError(
                f"training.select_direction={direction} contradicts training.select_by='{name}': "
                f"{'higher' if known[name] == 'maximize' else 'lower'} is better; leave select_direction unset"
            )
        return name, known[name]
    if not own_metrics or not name.startswith("val_"):
        raise ValueError(
            f"training.select_by='{name}' is not a metric the validation gives; available: {sorted(known)}"
            + (" or val_<name> of the model's own metrics()" if own_metrics else "")
        )
    direction = direction or (own_directions or {}).get(name)
    if direction is None:
        raise ValueError(
            f"training.select_by='{name}' is not one of {sorted(known)}, so it must come from the model's own "
            "metrics(): set training.select_direction (maximize or minimize) to say which way is better"
        )
    return name, direction


def _ranking_hint(chosen: str, group_key: str | None, ks: list[int]) -> str:
    """What a ranking metric that is not there needs: `data.group_key`, or its cutoff in `evaluation.k`."""
    name = chosen.rsplit("/", 1)[-1]
    metric, _, k = name.partition("@")
    if metric not in RANKING_METRICS:
        return ""
    if group_key is None:
        return f" ({name} is a ranking metric: set data.group_key, the column whose rows are ranked together)"
    if k.isdigit() and int(k) not in ks:
        return f" (add {k} to evaluation.k, now {ks}, for {name})"
    return ""
