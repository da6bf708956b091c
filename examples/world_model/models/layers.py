"""Layers the world model shares (imported by models/world.py: an edit here retrains, as an edit there does)."""

import torch
from torch import nn


class FrameEmbedding(nn.Module):
    """[B, K, n_cont] floats and [B, K, n_cat] ids -> [B, K, width]: every categorical column embedded
    (id 0 is a value unseen in training), concatenated with the continuous features."""

    def __init__(self, n_cont: int, cardinalities: list[int], dim: int = 8):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(c, min(dim, c)) for c in cardinalities)
        self.width = n_cont + sum(min(dim, c) for c in cardinalities)

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        parts = [cont.float(), *(emb(cat[..., i]) for i, emb in enumerate(self.embeddings))]
        return torch.cat(parts, dim=-1)
