"""Metrics of text models: perplexity, a unigram baseline's perplexity, and the exact match and token F1
of generated text against references (SQuAD-style: whitespace tokens, lower-cased, multiset overlap)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np


def perplexity(mean_loss: float) -> float:
    """exp of a mean next-token cross-entropy (in nats): the number of equally likely tokens the model is as
    unsure as; infinity where the loss is too large for a float."""
    if not mean_loss >= 0:
        raise ValueError(f"a mean token loss must be a number >= 0 (cross-entropy in nats), got {mean_loss}")
    return math.exp(mean_loss) if mean_loss < 709 else math.inf


def unigram_perplexity(train_counts: Sequence[int] | np.ndarray, eval_counts: Sequence[int] | np.ndarray) -> float:
    """The perplexity, on tokens counted by id in `eval_counts`, of the unigram model of `train_counts` (each
    token's training frequency, add-one smoothed so an unseen token is not impossible): the baseline a
    language model must beat. Id 0 (padding) is counted in neither."""
    train = np.asarray(train_counts, dtype=np.float64)[1:]
    held = np.asarray(eval_counts, dtype=np.float64)[1:]
    if train.shape != held.shape:
        raise ValueError(
            f"train and eval counts must cover the same vocabulary: {train.shape[0] + 1} vs {held.shape[0] + 1}"
        )
    if held.sum() == 0:
        raise ValueError("no tokens to score: eval_counts is all zero (besides padding)")
    probs = (train + 1.0) / (train.sum() + len(train))
    return perplexity(float(-(held * np.log(probs)).sum() / held.sum()))


def _tokens(text: str) -> list[str]:
    return text.lower().split()


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the tokens two texts share (whitespace tokens, lower-cased, counted as a multiset); two empty
    texts agree (1.0), an empty and a non-empty one do not (0.0)."""
    pred, ref = _tokens(prediction), _tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def text_generation_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """`exact_match` (the share of predictions equal to their reference, lower-cased, whitespace ignored) and
    `token_f1` (the mean of each pair's token F1)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references: give one of each per row")
    if not predictions:
        raise ValueError("no predictions to score")
    exact = [_tokens(p) == _tokens(r) for p, r in zip(predictions, references)]
    f1 = [token_f1(p, r) for p, r in zip(predictions, references)]
    return {"exact_match": sum(exact) / len(exact), "token_f1": sum(f1) / len(f1)}
