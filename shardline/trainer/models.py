"""The two model families over a window of frames: an MLP on the flattened window, and a Transformer.

Both embed every categorical column and concatenate the embeddings with the continuous features, so a
frame is one vector of F numbers. A model is fully described by its `spec` (a plain JSON dict), which
is what checkpoints store and what `model_from_spec` rebuilds from.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.core.config import ModelConfig

SPEC_VERSION = 2  # 2: the categorical embeddings of one width share one table (v1: a table per column)
SPEC_VERSIONS = (1, 2)  # v1 models (registered before) still load and predict


def embedding_width(cardinality: int, embedding_dim: int | None = None) -> int:
    """Width of one categorical column's embedding: the configured one, or min(32, round(1.6 * card**0.56))."""
    if embedding_dim is not None:
        return embedding_dim
    return max(1, min(32, round(1.6 * cardinality**0.56)))


def model_spec(cfg: ModelConfig | dict, n_cont: int, cat_cardinalities: list[int], window: int, n_outputs: int) -> dict:
    """The JSON description of a model: `model_from_spec(model_spec(...))` builds it."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.model_validate(cfg)
    if n_cont < 0 or window < 1 or n_outputs < 1:
        raise ValueError(
            f"bad model shape: n_cont={n_cont} (>= 0), window={window} (>= 1), n_outputs={n_outputs} (>= 1)"
        )
    if n_cont == 0 and not cat_cardinalities:
        raise ValueError(
            "a model needs at least one feature: n_cont is 0 and there is no categorical column; "
            "list columns under data.features (continuous, boolean or categorical)"
        )
    bad = [c for c in cat_cardinalities if int(c) < 1]
    if bad:
        raise ValueError(
            f"categorical cardinalities must be >= 1 (id 0 is the unseen value), got {list(cat_cardinalities)}"
        )
    return {
        "version": SPEC_VERSION,
        "model": cfg.model_dump(mode="json"),
        "n_cont": int(n_cont),
        "cat_cardinalities": [int(c) for c in cat_cardinalities],
        "window": int(window),
        "n_outputs": int(n_outputs),
    }


class FrameEncoder(nn.Module):
    """[B, K, n_cont] floats + [B, K, n_cat] ids -> [B, K, F] frame vectors.

    Every categorical column has its own embedding of its own width. Columns of the same width are
    stored in one table (each column's rows at an offset), so a step costs one lookup and one
    backward per width rather than per column: on a GPU, 37 per-column embedding backwards made a
    small model launch-bound (~1,000 kernel launches per step). `fused=False` is the v1 layout
    (one `nn.Embedding` per column), kept so that earlier models load.
    """

    def __init__(self, n_cont: int, cat_cardinalities: list[int], embedding_dim: int | None, fused: bool = True):
        super().__init__()
        widths = [embedding_width(c, embedding_dim) for c in cat_cardinalities]
        self.fused = fused
        self.width = n_cont + sum(widths)
        if not fused:
            self.embeddings = nn.ModuleList(nn.Embedding(c, w) for c, w in zip(cat_cardinalities, widths))
            return
        by_width: dict[int, list[int]] = {}
        for i, w in enumerate(widths):
            by_width.setdefault(w, []).append(i)
        self.tables = nn.ModuleList()
        self.groups = list(by_width.values())
        for g, cols in enumerate(self.groups):
            cards = [cat_cardinalities[i] for i in cols]
            self.tables.append(nn.Embedding(sum(cards), widths[cols[0]]))
            offsets = torch.tensor([0, *cards[:-1]], dtype=torch.long).cumsum(0)
            self.register_buffer(f"columns_{g}", torch.tensor(cols, dtype=torch.long), persistent=False)
            self.register_buffer(f"offsets_{g}", offsets, persistent=False)

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        parts = [cont.float()]
        if not self.fused:
            parts += [emb(cat[..., i]) for i, emb in enumerate(self.embeddings)]
            return torch.cat(parts, dim=-1)
        for g, table in enumerate(self.tables):
            ids = cat.index_select(-1, getattr(self, f"columns_{g}")).long() + getattr(self, f"offsets_{g}")
            parts.append(table(ids).flatten(-2))  # [B, K, columns * width]
        return torch.cat(parts, dim=-1)


class WindowMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        n_cont: int,
        cat_cardinalities: list[int],
        window: int,
        n_outputs: int,
        fused: bool = True,
    ):
        super().__init__()
        self.frames = FrameEncoder(n_cont, cat_cardinalities, cfg.embedding_dim, fused=fused)
        blocks: list[nn.Module] = []
        width = window * self.frames.width
        for _ in range(cfg.layers):
            blocks += [nn.Linear(width, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout)]
            width = cfg.hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, n_outputs)

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        x = self.frames(cont, cat).flatten(1)  # [B, K*F]
        return self.head(self.body(x)).float()


class WindowTransformer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        n_cont: int,
        cat_cardinalities: list[int],
        window: int,
        n_outputs: int,
        fused: bool = True,
    ):
        super().__init__()
        self.frames = FrameEncoder(n_cont, cat_cardinalities, cfg.embedding_dim, fused=fused)
        self.proj = nn.Linear(self.frames.width, cfg.hidden)
        self.position = nn.Embedding(window, cfg.hidden)
        layer = nn.TransformerEncoderLayer(
            cfg.hidden,
            cfg.heads,
            dim_feedforward=4 * cfg.hidden,
            dropout=cfg.dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # nested tensors only help with padding masks, which windows never have
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, n_outputs)

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.frames(cont, cat))
        x = x + self.position.weight[: x.shape[1]]
        x = self.encoder(x)
        # the target follows the window's last frame, which has attended to all the others
        return self.head(self.norm(x[:, -1])).float()


FAMILIES = {"mlp": WindowMLP, "transformer": WindowTransformer}


def model_from_spec(spec: dict) -> nn.Module:
    """Build the (freshly initialised) model a spec describes; the spec is kept as `model.spec`."""
    if spec.get("version") not in SPEC_VERSIONS:
        raise ValueError(
            f"model spec version {spec.get('version')!r} is not supported (this Shardline reads {list(SPEC_VERSIONS)})"
        )
    cfg = ModelConfig.model_validate(spec["model"])
    model = FAMILIES[cfg.family](
        cfg, spec["n_cont"], spec["cat_cardinalities"], spec["window"], spec["n_outputs"], fused=spec["version"] >= 2
    )
    model.spec = dict(spec)
    return model


def build_model(cfg: ModelConfig, n_cont: int, cat_cardinalities: list[int], window: int, n_outputs: int) -> nn.Module:
    """forward(cont [B,K,n_cont], cat [B,K,n_cat]) -> float32 [B, n_outputs] (regression: n_outputs=1)."""
    return model_from_spec(model_spec(cfg, n_cont, cat_cardinalities, window, n_outputs))
