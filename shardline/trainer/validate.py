"""Validation: each epoch's metrics on the validation split, the one the run selects its best epoch by, and
whether an epoch beats the best so far."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardline.core.config import (
    TrainingConfig,
    is_ranking_validation,
    resolve_selection,
    validation_metrics,
    validation_name,
    validation_ranking_names,
)
from shardline.core.metrics.split_ranking import SplitRanking
from shardline.core.metrics.text import perplexity
from shardline.trainer.contract import (
    DataSpec,
    ModelContractError,
    as_outputs,
    batch_targets,
    check_outputs,
    check_own_metrics,
    default_loss,
    model_loss,
    own_hook,
)
from shardline.trainer.data import ScoredLoader, SplitData
from shardline.trainer.models import data_spec_of


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
    own_metrics = own_hook(model, "metrics")
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
    checked = False
    for batch in loader:
        b = batch.to(device)
        targets = batch_targets(spec, b)
        with ctx or contextlib.nullcontext():
            outputs = as_outputs(model(b.cont, b.cat), spec)
        if not checked:  # in eval mode, as predicting runs it: the first training batch was checked in train mode
            try:
                check_outputs(outputs, spec, len(b))
            except ModelContractError as e:
                raise ModelContractError(f"in eval mode (validation): {e}") from None
            checked = True
        if own_hook(model, "loss") is not None:  # the model's own objective, a batch mean
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
            given = own_metrics(outputs, b.cont, b.cat, targets)
            if first == 0:  # none of the validation's own names: those are added below
                taken = {"val_loss", *names.values(), *(["val_perplexity"] if ignore is not None else [])}
                if ranking is not None:
                    ranked = validation_ranking_names(spec.targets[0].name, len(spec.targets) > 1, ranking.ks)
                    taken |= set(ranked.values())
                check_own_metrics(given, model, taken)
            for key, value in given.items():
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


def selection(cfg: TrainingConfig, spec: DataSpec, ranking: SplitRanking | None) -> tuple[str, str | None, dict]:
    """(the metric the best epoch is chosen by, "minimize" or "maximize", every metric validation names with its
    direction). Text data: its target validated as a generation (val_perplexity, val_accuracy on the real target
    tokens); ranking data: the ranking metrics of the validation split's groups (val_ndcg_at_10, ...)."""
    known = validation_metrics(
        [(t.name, "generation" if spec.text is not None else t.kind) for t in spec.targets],
        ranking.ks if ranking else (),
    )
    select_by = cfg.select_by or "val_loss"
    if ranking is None and select_by not in known and is_ranking_validation(select_by):
        raise ValueError(
            f"training.select_by='{select_by}' is a ranking metric of the validation split: pass fit() the split's "
            "rows to rank (ranking=SplitRanking(manifest, manifest_uri, validation split, evaluation.k)), or set "
            "training.select_by to another metric"
        )
    return select_by, cfg.select_direction or known.get(select_by), known


def check_selection(model: nn.Module, select_by: str, direction: str | None, known: dict) -> None:
    """A name the validation never gives fails here, before any step (a model's own metrics: at the first epoch
    end, `check_selected`)."""
    resolve_selection(select_by, direction, known, own_hook(model, "metrics") is not None)


def check_selected(metrics: dict, select_by: str, ranking: SplitRanking | None, val: SplitData) -> None:
    """The selection metric is among an epoch's validation metrics (before any epoch is marked best)."""
    if select_by not in metrics:  # a model's own metric it did not return
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
