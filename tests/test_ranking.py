"""Ranking metrics (shardline/core/metrics/ranking.py) against hand arithmetic from the textbook definitions and
against a slow per-group reference written here: nDCG with gain 2**rel - 1 and discount 1/log2(rank + 1),
AP@k over min(k, R), recall@k, MRR uncut and at k; ties stable or averaged over every order of the tied
rows; groups with no relevant row left out; batches equal to one call; the popularity baseline."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest

from shardline.core.metrics.ranking import PopularityCounts, RankingScores, ranking_metrics

LOG2_3 = math.log2(3)  # 1.5849625; the discount at rank 2 is 1/log2(3) = 0.6309298
LOG2_5 = math.log2(5)  # 2.3219281; the discount at rank 4 is 1/log2(5) = 0.4306766


def approx(values: dict) -> dict:
    return {key: pytest.approx(v, rel=1e-12, abs=1e-15) for key, v in values.items()}


# --------------------------------------------------------------------------- the slow reference


def reference_group(ranked: list[int], ks: list[int]) -> dict[str, float]:
    """The metrics of one group from its grades in rank order, straight from the definitions."""
    ideal = sorted(ranked, reverse=True)
    n_relevant = sum(r > 0 for r in ranked)
    first = next(i for i, r in enumerate(ranked, start=1) if r > 0)
    out = {}
    for k in ks:
        dcg = sum((2**r - 1) / math.log2(i + 1) for i, r in enumerate(ranked[:k], start=1))
        idcg = sum((2**r - 1) / math.log2(i + 1) for i, r in enumerate(ideal[:k], start=1))
        hits, precision_sum = 0, 0.0
        for i, r in enumerate(ranked[:k], start=1):
            if r > 0:
                hits += 1
                precision_sum += hits / i
        out[f"ndcg@{k}"] = dcg / idcg
        out[f"map@{k}"] = precision_sum / min(k, n_relevant)
        out[f"recall@{k}"] = hits / n_relevant
        out[f"mrr@{k}"] = 1 / first if first <= k else 0.0
    out["mrr"] = 1 / first
    return out


def reference(groups, scores, relevance, ks: list[int], ties: str) -> dict[str, float]:
    rows = defaultdict(list)
    for i, (g, s, r) in enumerate(zip(groups, scores, relevance)):
        rows[g].append((s, i, int(r)))
    per_group = []
    for group_rows in rows.values():
        if not any(r > 0 for _, _, r in group_rows):
            continue
        if ties == "stable":
            ranked = [r for _, _, r in sorted(group_rows, key=lambda row: (-row[0], row[1]))]
            per_group.append(reference_group(ranked, ks))
        else:
            # every order of the tied rows, each equally likely
            levels = sorted({s for s, _, _ in group_rows}, reverse=True)
            blocks = [[r for s, _, r in group_rows if s == level] for level in levels]
            orders = [sum(map(list, parts), []) for parts in itertools.product(*map(itertools.permutations, blocks))]
            each = [reference_group(order, ks) for order in orders]
            per_group.append({key: sum(e[key] for e in each) / len(each) for key in each[0]})
    out = {key: sum(p[key] for p in per_group) / len(per_group) for key in per_group[0]}
    out["groups"] = len(rows)
    out["groups_with_relevant"] = len(per_group)
    return out


def random_ranking(rng: np.random.Generator, n_groups: int, max_size: int, n_levels: int):
    """Groups of 1..max_size rows, interleaved; scores on a few levels (many ties); grades 0..3, mostly 0."""
    sizes = rng.integers(1, max_size + 1, size=n_groups)
    groups = np.repeat(np.arange(n_groups) * 7 + 3, sizes)  # ids that are not 0..n-1
    order = rng.permutation(groups.size)
    groups = groups[order]
    scores = rng.integers(0, n_levels, size=groups.size) / 2.0
    relevance = rng.choice(4, size=groups.size, p=[0.6, 0.2, 0.1, 0.1])
    return groups, scores, relevance


# --------------------------------------------------------------------------- hand-checked values


def test_hand_example_binary():
    # q1: scores .9 .8 .7 .6 -> ranked grades 1 0 1 0 (R = 2)
    #   nDCG@1 = 1/1 = 1
    #   nDCG@3 = (1/log2 2 + 0 + 1/log2 4) / (1/log2 2 + 1/log2 3) = (1 + 0.5) / (1 + 0.6309298) = 0.9197207
    #   AP@1 = (1/1) / min(1, 2) = 1;  AP@3 = (1/1 + 2/3) / min(3, 2) = 0.8333333
    #   recall@1 = 1/2, recall@3 = 2/2;  RR = 1/1, RR@1 = 1
    # q2: rows arrive as (.1, 1) (.5, 0) (.3, 0) -> ranked grades 0 0 1 (R = 1)
    #   nDCG@1 = 0;  nDCG@3 = (1/log2 4) / 1 = 0.5
    #   AP@1 = 0;  AP@3 = (1/3) / min(3, 1) = 0.3333333
    #   recall@1 = 0, recall@3 = 1;  RR = 1/3, RR@1 = 0 (first relevant at rank 3 > 1), RR@3 = 1/3
    # q3: grades 0 0, no relevant row: left out of every average
    groups = ["q1", "q2", "q1", "q2", "q1", "q3", "q2", "q1", "q3"]
    scores = [0.9, 0.1, 0.8, 0.5, 0.7, 0.2, 0.3, 0.6, 0.4]
    relevance = [1, 1, 0, 0, 1, 0, 0, 0, 0]
    ndcg3_q1 = 1.5 / (1 + 1 / LOG2_3)
    assert ndcg3_q1 == pytest.approx(0.9197207, abs=1e-7)
    assert ranking_metrics(groups, scores, relevance, [1, 3]) == approx(
        {
            "ndcg@1": (1 + 0) / 2,
            "ndcg@3": (ndcg3_q1 + 0.5) / 2,  # 0.7098604
            "map@1": (1 + 0) / 2,
            "map@3": (5 / 6 + 1 / 3) / 2,  # 0.5833333
            "recall@1": (0.5 + 0) / 2,
            "recall@3": (1 + 1) / 2,
            "mrr": (1 + 1 / 3) / 2,  # 0.6666667
            "mrr@1": (1 + 0) / 2,
            "mrr@3": (1 + 1 / 3) / 2,
            "groups": 3,
            "groups_with_relevant": 2,
        }
    )


def test_graded_ndcg():
    # one group, ranked grades 2 3 0 1: gains 2**rel - 1 = 3 7 0 1; discounts 1, 1/log2 3, 1/2, 1/log2 5
    #   DCG@4  = 3 + 7/1.5849625 + 0 + 1/2.3219281 = 3 + 4.4165083 + 0.4306766 = 7.8471848
    #   ideal grades 3 2 1 0, gains 7 3 1 0:
    #   IDCG@4 = 7 + 3/1.5849625 + 1/2 + 0 = 7 + 1.8927893 + 0.5 = 9.3927893 -> nDCG@4 = 0.8354478
    #   DCG@2 = 7.4165083, IDCG@2 = 8.8927893 -> nDCG@2 = 0.8339912
    # binary metrics read grade > 0: relevant at ranks 1, 2, 4 (R = 3)
    #   AP@4 = (1/1 + 2/2 + 3/4) / min(4, 3) = 2.75 / 3 = 0.9166667;  AP@2 = (1 + 1) / min(2, 3) = 1
    #   recall@2 = 2/3, recall@4 = 1;  RR = 1
    dcg4 = 3 + 7 / LOG2_3 + 1 / LOG2_5
    idcg4 = 7 + 3 / LOG2_3 + 0.5
    assert dcg4 / idcg4 == pytest.approx(0.8354478, abs=1e-7)
    got = ranking_metrics([5, 5, 5, 5], [4.0, 3.0, 2.0, 1.0], [2, 3, 0, 1], [2, 4])
    assert got == approx(
        {
            "ndcg@2": (3 + 7 / LOG2_3) / (7 + 3 / LOG2_3),
            "ndcg@4": dcg4 / idcg4,
            "map@2": 1.0,
            "map@4": 2.75 / 3,
            "recall@2": 2 / 3,
            "recall@4": 1.0,
            "mrr": 1.0,
            "mrr@2": 1.0,
            "mrr@4": 1.0,
            "groups": 1,
            "groups_with_relevant": 1,
        }
    )


def test_ties_stable_keep_arrival_order():
    # scores .7 .7 .2: the two tied rows rank in the order they arrive, whichever is relevant
    # relevant second: rank 2 -> nDCG@3 = (1/log2 3) / 1 = 0.6309298, AP@3 = (1/2) / 1, RR = 1/2, recall@1 = 0
    second = ranking_metrics([0, 0, 0], [0.7, 0.7, 0.2], [0, 1, 0], [1, 3])
    assert second["ndcg@3"] == pytest.approx(1 / LOG2_3)
    assert (second["map@3"], second["mrr"], second["recall@1"]) == (0.5, 0.5, 0.0)
    # relevant first: rank 1 -> every metric 1
    first = ranking_metrics([0, 0, 0], [0.7, 0.7, 0.2], [1, 0, 0], [1, 3])
    assert (first["ndcg@3"], first["map@3"], first["mrr"], first["recall@1"]) == (1.0, 1.0, 1.0, 1.0)


def test_ties_average_hand_values():
    # scores .7 .7 .2, one of the tied rows relevant: rank 1 or 2, each with chance 1/2
    #   E[nDCG@3] = (1 + 1/log2 3) / 2 = (1 + 0.6309298) / 2 = 0.8154649;  E[nDCG@1] = (1 + 0) / 2
    #   E[AP@3] = E[RR] = (1/1 + 1/2) / 2 = 0.75;  E[recall@1] = E[RR@1] = 1/2
    # and the same whichever of the tied rows is the relevant one
    for relevance in ([0, 1, 0], [1, 0, 0]):
        got = ranking_metrics([0, 0, 0], [0.7, 0.7, 0.2], relevance, [1, 3], ties="average")
        assert got == approx(
            {
                "ndcg@1": 0.5,
                "ndcg@3": (1 + 1 / LOG2_3) / 2,
                "map@1": 0.5,
                "map@3": 0.75,
                "recall@1": 0.5,
                "recall@3": 1.0,
                "mrr": 0.75,
                "mrr@1": 0.5,
                "mrr@3": 0.75,
                "groups": 1,
                "groups_with_relevant": 1,
            }
        )

    # three tied rows, two relevant (R = 2): the non-relevant row is at rank 1, 2 or 3, chance 1/3 each
    #   at 3: relevant at 1, 2 -> AP@3 = (1/1 + 2/2) / 2 = 1,     RR = 1
    #   at 2: relevant at 1, 3 -> AP@3 = (1/1 + 2/3) / 2 = 5/6,   RR = 1
    #   at 1: relevant at 2, 3 -> AP@3 = (1/2 + 2/3) / 2 = 7/12,  RR = 1/2
    #   E[AP@3] = (12/12 + 10/12 + 7/12) / 3 = 29/36 = 0.8055556;  E[RR] = (1 + 1 + 1/2) / 3 = 5/6
    #   E[DCG@3] = (2/3 relevant at each rank) (1 + 1/log2 3 + 1/2) = 2/3 * 2.1309298 = 1.4206198
    #   IDCG@3 = 1 + 1/log2 3 = 1.6309298 -> E[nDCG@3] = 0.8710491
    got = ranking_metrics([0, 0, 0], [1.0, 1.0, 1.0], [1, 0, 1], [3], ties="average")
    assert got["map@3"] == pytest.approx(29 / 36)
    assert got["mrr"] == pytest.approx(5 / 6)
    assert got["ndcg@3"] == pytest.approx(2 / 3 * (1 + 1 / LOG2_3 + 0.5) / (1 + 1 / LOG2_3))
    assert got["ndcg@3"] == pytest.approx(0.8710491, abs=1e-7)


def test_groups_without_relevant_are_left_out():
    base = ranking_metrics([1, 1, 2, 2], [0.9, 0.1, 0.2, 0.8], [1, 0, 1, 0], [1, 2])
    # adding two groups with no relevant row changes only the count of groups
    more = ranking_metrics([1, 1, 2, 2, 3, 3, 4], [0.9, 0.1, 0.2, 0.8, 0.5, 0.4, 0.3], [1, 0, 1, 0, 0, 0, 0], [1, 2])
    assert more == {**base, "groups": 4, "groups_with_relevant": 2}
    # group 1 ranks its relevant row first, group 2 second: MRR (1 + 1/2) / 2 over the 2 groups, not over 4
    assert more["mrr"] == 0.75
    with pytest.raises(ValueError, match="no relevant row"):
        ranking_metrics([1, 1, 2], [0.3, 0.2, 0.1], [0, 0, 0], [1])


def test_k_beyond_group_size():
    # 2 rows, k = 10: the cutoff is the whole group; AP normalised by min(10, R = 1)
    # ranked grades 0 1 -> nDCG@10 = 1/log2 3, AP@10 = (1/2) / 1, recall@10 = 1, RR@10 = 1/2
    got = ranking_metrics(["u", "u"], [2, 1], [0, 1], [10])
    assert got == approx(
        {
            "ndcg@10": 1 / LOG2_3,
            "map@10": 0.5,
            "recall@10": 1.0,
            "mrr": 0.5,
            "mrr@10": 0.5,
            "groups": 1,
            "groups_with_relevant": 1,
        }
    )


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize("ties", ["stable", "average"])
def test_group_across_two_batches_equals_one_batch(ties):
    groups = ["a", "a", "b", "a", "b", "a", "b"]
    scores = [0.4, 0.9, 0.5, 0.4, 0.5, 0.1, 0.3]
    relevance = [0, 1, 0, 2, 1, 1, 0]
    whole = ranking_metrics(groups, scores, relevance, [1, 2, 5], ties=ties)
    streamed = RankingScores([1, 2, 5], ties=ties)
    streamed.update(groups[:3], scores[:3], relevance[:3])  # "a" and "b" both go on in the next batch
    streamed.update([], [], [])
    streamed.update(groups[3:], scores[3:], relevance[3:])
    assert streamed.rows == 7
    assert streamed.metrics() == whole


def test_batches_in_any_order_with_tie_average():
    rng = np.random.default_rng(3)
    groups, scores, relevance = random_ranking(rng, n_groups=50, max_size=12, n_levels=3)
    whole = ranking_metrics(groups, scores, relevance, [3, 10], ties="average")
    spans = np.array_split(np.arange(groups.size), 7)
    streamed = RankingScores([3, 10], ties="average")
    for span in rng.permutation(len(spans)):
        rows = spans[span]
        streamed.update(groups[rows], scores[rows], relevance[rows])
    assert streamed.metrics() == approx(whole)


# --------------------------------------------------------------------------- against the reference


def test_matches_reference_stable():
    rng = np.random.default_rng(0)
    groups, scores, relevance = random_ranking(rng, n_groups=200, max_size=30, n_levels=8)
    ks = [1, 3, 10]
    want = reference(groups.tolist(), scores.tolist(), relevance.tolist(), ks, "stable")
    assert 0 < want["groups_with_relevant"] < want["groups"] == 200
    assert ranking_metrics(groups, scores, relevance, ks) == approx(want)


def test_matches_reference_tie_average():
    rng = np.random.default_rng(1)
    groups, scores, relevance = random_ranking(rng, n_groups=200, max_size=6, n_levels=3)
    ks = [1, 2, 4]
    want = reference(groups.tolist(), scores.tolist(), relevance.tolist(), ks, "average")
    assert 0 < want["groups_with_relevant"] < want["groups"] == 200
    assert ranking_metrics(groups, scores, relevance, ks, ties="average") == approx(want)


def test_tie_average_equals_stable_without_ties():
    rng = np.random.default_rng(2)
    groups, _, relevance = random_ranking(rng, n_groups=100, max_size=20, n_levels=2)
    scores = rng.permutation(groups.size).astype(float)  # all distinct
    stable = ranking_metrics(groups, scores, relevance, [1, 5])
    assert ranking_metrics(groups, scores, relevance, [1, 5], ties="average") == approx(stable)


# --------------------------------------------------------------------------- popularity baseline


def test_popularity_baseline_on_a_toy_click_log():
    # training clicks per item (the manifest's item_counts): a 3, b 2, c 1, d seen but never clicked
    counts = PopularityCounts.from_counts({"a": 3, "b": 2, "c": 1, "d": 0})
    # test split: u1 sees c (clicked), a, e (never in training); u2 sees e, b (clicked), d
    users = ["u1", "u1", "u1", "u2", "u2", "u2"]
    items = ["c", "a", "e", "e", "b", "d"]
    clicked = [1, 0, 0, 0, 1, 0]
    scores = counts.scores(items)
    np.testing.assert_array_equal(scores, [1, 3, 0, 0, 2, 0])
    # u1 ranks a (3), c (1), e (0): its click at rank 2 -> nDCG@2 = 1/log2 3, RR = 1/2
    # u2 ranks b (2) first: its click at rank 1 -> nDCG@2 = 1, RR = 1
    got = ranking_metrics(users, scores, clicked, [2])
    assert got["ndcg@2"] == pytest.approx((1 / LOG2_3 + 1) / 2)  # 0.8154649
    assert got["mrr"] == 0.75
    assert got["recall@2"] == 1.0


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([1, 1], [0.5], [1, 0], [1]), {}, "group_ids, scores, relevance must have one entry per row"),
        (([1, 1], [0.5, float("nan")], [1, 0], [1]), {}, "scores contains 1 NaN"),
        (([1, 1], [0.5, 0.4], [1, -1], [1]), {}, "relevance contains negative grades"),
        (([1, 1], [0.5, 0.4], [1, 0.5], [1]), {}, "relevance must hold whole grades"),
        (([1, 1], [0.5, 0.4], [1, 2000], [1]), {}, "above the largest usable grade, 1023"),
        (([1, 1], [0.5, 0.4], [1, 0], [0]), {}, "ks must hold whole numbers >= 1"),
        (([1, 1], [0.5, 0.4], [1, 0], []), {}, "ks is empty"),
        (([], [], [], [1]), {}, "empty"),
        (([1.5, 1.5], [0.5, 0.4], [1, 0], [1]), {}, "group_ids must hold integer or string ids"),
        (([1, 1], [[0.5, 0.4]], [1, 0], [1]), {}, "scores must be 1-D"),
        (([1, 1], [0.5, 0.4], [1, 0], [1]), {"ties": "random"}, "ties must be one of"),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ranking_metrics(*args, **kwargs)


def test_bad_input_streaming():
    with pytest.raises(ValueError, match="ks must hold whole numbers >= 1"):
        RankingScores([5, 0])
    scores = RankingScores([5])
    with pytest.raises(ValueError, match="no rows"):
        scores.metrics()
    scores.update([1, 2], [0.1, 0.2], [1, 1])
    with pytest.raises(ValueError, match="group_ids holds string ids in this batch but integer ids"):
        scores.update(["x"], [0.3], [1])


def test_popularity_counts_unseen_items_and_no_counts_score_0():
    counts = {"a": 3, "b": 0, "c": 7}
    table = PopularityCounts.from_counts(counts)
    items = np.array(["c", "z", "a", "b", "a"])
    np.testing.assert_array_equal(table.scores(items), [7.0, 0.0, 3.0, 0.0, 3.0])
    assert PopularityCounts.from_counts({}).scores(items).tolist() == [0.0] * 5
