"""A user's own repository, written by the tests into a folder outside Shardline's: a model package
(`models/`, written only from the README's model contract) with a helper module, and its config."""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

WORLD = '''
"""A GRU over the window with one head per target: a user's model, written from the README's contract."""

import torch
from torch import nn

from models.helpers import embedding_width


class WindowGRU(nn.Module):
    def __init__(self, spec, hidden=16, dropout=0.1):
        super().__init__()
        self.spec = spec
        self.embed = nn.ModuleList(nn.Embedding(c, embedding_width(c)) for c in spec.cardinalities)
        width = spec.n_cont + sum(embedding_width(c) for c in spec.cardinalities)
        self.gru = nn.GRU(width, hidden, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.heads = nn.ModuleDict(
            {t.name: nn.Linear(hidden, t.n_classes if t.kind == "classification" else 1) for t in spec.targets}
        )

    def forward(self, cont, cat):
        x = torch.cat([cont.float(), *(e(cat[..., i]) for i, e in enumerate(self.embed))], dim=-1)
        h, _ = self.gru(x)
        last = self.drop(h[:, -1])
        out = {}
        for t in self.spec.targets:
            y = self.heads[t.name](last)
            out[t.name] = y if t.kind == "classification" else y[:, 0]
        return out
'''

HELPERS = """
def embedding_width(cardinality):
    return 4
"""


def write_project(folder: Path, config: dict | None = None, helpers: str = HELPERS, world: str = WORLD) -> Path:
    """The user's repository at `folder`: models/{__init__,world,helpers}.py and shardline.yaml (when
    `config` is given, with `model.entrypoint: models.world:WindowGRU`). Returns the config's path."""
    (folder / "models").mkdir(parents=True, exist_ok=True)
    (folder / "models" / "__init__.py").write_text("")
    (folder / "models" / "world.py").write_text(textwrap.dedent(world).lstrip())
    (folder / "models" / "helpers.py").write_text(textwrap.dedent(helpers).lstrip())
    path = folder / "shardline.yaml"
    if config is not None:
        config = {**config, "model": {"entrypoint": "models.world:WindowGRU", "params": {"hidden": 16}}}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
