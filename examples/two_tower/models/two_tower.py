"""A two-tower ranker: a query tower over the user's columns, an item tower over the item's, and the score
of a (user, item) row is the dot product of their outputs. Written from Shardline's model contract (README:
"Your own model"): built as `TwoTower(spec, **model.params)`, `forward(cont, cat)` returns `{target:
logits}`, and Shardline's default loss (cross-entropy) trains it.

The towers never see each other's columns, so the item tower's vectors can be computed once for a whole
catalogue and searched by the user's vector (what makes two towers fast to serve). The item tower's
vector carries one more number, the item's bias, which the query tower meets with a constant 1: the
score is still one dot product, `[q, 1] . [v, b]`.

The target is a 0/1 click, a class target: Shardline gives it ids 1 and 2, by training frequency, so
with clicks rarer than non-clicks id 2 is the click. The logits are 0 for id 1 and the score for id 2,
so the probability of a click is sigmoid(score), and evaluation ranks a session's items by it."""

from __future__ import annotations

import torch
from torch import nn


class Tower(nn.Module):
    """Some of the window's continuous and categorical columns -> a vector of `out` numbers."""

    def __init__(self, spec, columns: list[str], out: int, hidden: int, embedding: int):
        super().__init__()
        unknown = [c for c in columns if c not in spec.continuous and c not in spec.cat_columns]
        if unknown:
            raise ValueError(
                f"tower column(s) {unknown} are not features of the data; the features are "
                f"{spec.continuous + spec.cat_columns}"
            )
        conts = [spec.continuous.index(c) for c in columns if c in spec.continuous]
        cats = [spec.cat_columns.index(c) for c in columns if c in spec.cat_columns]
        self.register_buffer("cont_at", torch.tensor(conts, dtype=torch.long))
        self.register_buffer("cat_at", torch.tensor(cats, dtype=torch.long))
        self.embed = nn.ModuleList(nn.Embedding(spec.cardinalities[j], embedding) for j in cats)
        width = len(self.cont_at) + embedding * len(cats)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, out))

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        parts = [cont[:, self.cont_at].float()]
        parts += [e(cat[:, j]) for e, j in zip(self.embed, self.cat_at.tolist())]
        return self.mlp(torch.cat(parts, dim=-1))


class TwoTower(nn.Module):
    def __init__(self, spec, query: list[str], item: list[str], dim: int = 32, hidden: int = 64, embedding: int = 16):
        super().__init__()
        if len(spec.targets) != 1 or spec.targets[0].kind != "classification":
            raise ValueError("TwoTower ranks by one 0/1 click target (data.target, task: classification)")
        if spec.targets[0].n_classes != 3:  # <unseen>, 0 and 1
            raise ValueError(
                f"TwoTower ranks by one 0/1 click target, and the training split's '{spec.targets[0].name}' holds "
                f"{spec.targets[0].n_classes - 1} distinct value(s): keep its clicks 0 and 1 (a grade above 1 needs "
                "a model that scores grades)"
            )
        self.target = spec.targets[0].name
        self.query = Tower(spec, query, dim, hidden, embedding)
        self.item = Tower(spec, item, dim + 1, hidden, embedding)  # its last number: the item's bias

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        cont, cat = cont[:, -1], cat[:, -1]  # one row per window: the (user, item) pair
        q = self.query(cont, cat)
        v = self.item(cont, cat)
        score = (torch.cat([q, torch.ones_like(q[:, :1])], dim=-1) * v).sum(-1)
        logits = torch.stack([torch.zeros_like(score), torch.zeros_like(score), score], dim=-1)
        return {self.target: logits}
