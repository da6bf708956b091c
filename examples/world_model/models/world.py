"""A small world model: a GRU over the window of frames, predicting the next frame with one head per
target (player 1's action, x, y and whether they are on the ground). Written from Shardline's model
contract (README: "Your own model"): built as `WorldModel(spec, **model.params)`, `forward(cont, cat)`
returns `{target: tensor}`, and Shardline's default loss (cross-entropy or MSE per target, summed with
`training.loss_weights`) trains it."""

import torch
from torch import nn

from models.layers import FrameEmbedding


class WorldModel(nn.Module):
    def __init__(self, spec, hidden: int = 64, layers: int = 1, dropout: float = 0.1):
        super().__init__()
        self.targets = list(spec.targets)
        self.frames = FrameEmbedding(spec.n_cont, spec.cardinalities)
        self.gru = nn.GRU(self.frames.width, hidden, num_layers=layers, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.heads = nn.ModuleDict(
            {t.name: nn.Linear(hidden, t.n_classes if t.kind == "classification" else 1) for t in spec.targets}
        )

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        h, _ = self.gru(self.frames(cont, cat))  # [B, K, hidden]
        last = self.drop(h[:, -1])  # the window's last frame has seen all of it
        out = {}
        for t in self.targets:
            y = self.heads[t.name](last)
            out[t.name] = y if t.kind == "classification" else y[:, 0]  # [B, classes] or [B]
        return out
