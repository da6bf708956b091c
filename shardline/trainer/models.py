"""The built-in model families: over a window of frames, an MLP on the flattened window and a
Transformer; over a window of tokens, a GPT (shardline/trainer/gpt.py). Each implements the model
contract (shardline/trainer/contract.py), as a user's own model does; and how a model is described
(`model_spec_for`: a plain JSON dict, which checkpoints store) and rebuilt (`model_from_spec`).
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.core.config import ModelConfig
from shardline.trainer.contract import DataSpec, TargetInfo, build_user_model
from shardline.trainer.gpt import GPT

# 2: the categorical embeddings of one width share one table (v1: a table per column); 3: the model
# contract (a data spec with named features and targets, the user's entrypoint)
SPEC_VERSION = 3
SPEC_VERSIONS = (1, 2, 3)  # v1 and v2 models (registered before) still load and predict


def embedding_width(cardinality: int, embedding_dim: int | None = None) -> int:
    """Width of one categorical column's embedding: the configured one, or min(32, round(1.6 * card**0.56))."""
    if embedding_dim is not None:
        return embedding_dim
    return max(1, min(32, round(1.6 * cardinality**0.56)))


def legacy_data_spec(n_cont: int, cat_cardinalities: list[int], window: int, n_outputs: int) -> DataSpec:
    """The data spec of a model described by shapes only (spec versions 1 and 2; tests): one target
    named `target`, a classification when it has more than one output."""
    kind = "classification" if n_outputs > 1 else "regression"
    return DataSpec(
        continuous=[f"cont_{i}" for i in range(n_cont)],
        boolean=[],
        categorical=[f"cat_{i}" for i in range(len(cat_cardinalities))],
        cardinalities=[int(c) for c in cat_cardinalities],
        window=int(window),
        targets=[TargetInfo("target", kind, int(n_outputs) if kind == "classification" else None)],
    )


def _check_shape(data: DataSpec, builtin: bool = True) -> None:
    if data.window < 1 or (builtin and not data.targets):
        raise ValueError(f"bad model shape: window={data.window} (>= 1), {len(data.targets)} target(s) (>= 1)")
    if data.n_cont == 0 and not data.cardinalities:
        raise ValueError(
            "a model needs at least one feature: n_cont is 0 and there is no categorical column; "
            "list columns under data.features (continuous, boolean or categorical)"
        )
    if any(int(c) < 1 for c in data.cardinalities):
        raise ValueError(
            f"categorical cardinalities must be >= 1 (id 0 is the unseen value), got {list(data.cardinalities)}"
        )
    for t in data.targets:
        if t.kind == "classification" and (t.n_classes or 0) < 2:
            raise ValueError(f"target '{t.name}': a classification needs >= 2 classes (id 0 is 'unseen')")


def model_spec_for(cfg: ModelConfig | dict, data: DataSpec) -> dict:
    """The JSON description of a model (checkpoints store it): `model_from_spec(model_spec_for(...))` builds it."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.model_validate(cfg)
    _check_shape(data, builtin=not cfg.entrypoint)
    # model.requirements says what the registered model installs, not what is trained: not part of the spec
    model = cfg.model_dump(mode="json", exclude={"requirements"})
    return {"version": SPEC_VERSION, "model": model, "data": data.to_dict()}


def model_spec(cfg: ModelConfig | dict, n_cont: int, cat_cardinalities: list[int], window: int, n_outputs: int) -> dict:
    """A model spec from shapes alone (one target named `target`): for tests and benchmarks."""
    return model_spec_for(cfg, legacy_data_spec(n_cont, cat_cardinalities, window, n_outputs))


def data_spec_of(spec: dict) -> DataSpec:
    """The data spec a model spec describes (any version)."""
    if spec.get("version", 0) >= 3:
        return DataSpec.from_dict(spec["data"])
    return legacy_data_spec(spec["n_cont"], spec["cat_cardinalities"], spec["window"], spec["n_outputs"])


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


class _Heads(nn.Module):
    """One linear head per target on a shared representation: [B, n_classes] or [B] per target. A single
    target's head is `head` (as in models saved before several targets), several are `heads[name]`."""

    def _add_heads(self, width: int, data: DataSpec) -> None:
        self.target_specs = list(data.targets)
        sizes = {t.name: (t.n_classes if t.kind == "classification" else 1) for t in data.targets}
        if len(sizes) == 1:
            self.head = nn.Linear(width, next(iter(sizes.values())))
        else:
            self.heads = nn.ModuleDict({name: nn.Linear(width, n) for name, n in sizes.items()})

    def _outputs(self, x: torch.Tensor, every: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each target's head on `x` [B, width], or on `every` [B, K, width] for a target predicted at every
        position."""
        out = {}
        for t in self.target_specs:
            head = self.head if hasattr(self, "head") else self.heads[t.name]
            y = head(every if t.positions == "all" else x).float()
            out[t.name] = y if t.kind == "classification" else y[..., 0]
        return out


class WindowMLP(_Heads):
    """The window's frames flattened, then `layers` blocks of Linear + GELU + dropout."""

    def __init__(
        self,
        spec: DataSpec,
        hidden: int = 256,
        layers: int = 2,
        dropout: float = 0.1,
        embedding_dim: int | None = None,
        fused: bool = True,
    ):
        super().__init__()
        self.frames = FrameEncoder(spec.n_cont, spec.cardinalities, embedding_dim, fused=fused)
        blocks: list[nn.Module] = []
        width = spec.window * self.frames.width
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*blocks)
        self._add_heads(width, spec)

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.frames(cont, cat).flatten(1)  # [B, K*F]
        return self._outputs(self.body(x))


class WindowTransformer(_Heads):
    """Each frame projected to `hidden`, with a learned position, through a pre-norm Transformer encoder;
    the targets are read from the window's last frame, which has attended to all the others. A target
    predicted at every position is read from each frame, and attention is then causal (a frame sees
    itself and the frames before it, never the rows it predicts)."""

    # one row per frame of the window: a fine-tune of another data.window is refused, not re-initialised
    shardline_position_tables = ("position.weight",)

    def __init__(
        self,
        spec: DataSpec,
        hidden: int = 256,
        layers: int = 2,
        heads: int = 4,
        dropout: float = 0.1,
        embedding_dim: int | None = None,
        fused: bool = True,
    ):
        super().__init__()
        self.frames = FrameEncoder(spec.n_cont, spec.cardinalities, embedding_dim, fused=fused)
        self.proj = nn.Linear(self.frames.width, hidden)
        self.position = nn.Embedding(spec.window, hidden)
        layer = nn.TransformerEncoderLayer(
            hidden,
            heads,
            dim_feedforward=4 * hidden,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # nested tensors only help with padding masks, which windows never have
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self._add_heads(hidden, spec)
        self.causal = any(t.positions == "all" for t in spec.targets)

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.proj(self.frames(cont, cat))
        x = x + self.position.weight[: x.shape[1]]
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
            x = self.norm(self.encoder(x, mask=mask, is_causal=True))
            return self._outputs(x[:, -1], every=x)
        x = self.encoder(x)
        return self._outputs(self.norm(x[:, -1]))


FAMILIES = {"mlp": WindowMLP, "transformer": WindowTransformer, "gpt": GPT}
FRAME_FAMILIES = ("mlp", "transformer")  # over frames of features (FrameEncoder): they take `fused`


def builtin_params(cfg: ModelConfig) -> dict:
    """A built-in family's keyword arguments, from the model config."""
    if cfg.family == "gpt":  # model.hidden/layers/heads under nanoGPT's names; model.params may set them too
        return cfg.gpt_params()
    params = {"hidden": cfg.hidden, "layers": cfg.layers, "dropout": cfg.dropout, "embedding_dim": cfg.embedding_dim}
    if cfg.family == "transformer":
        params["heads"] = cfg.heads
    return {**params, **cfg.params}


_FROM_SPEC = object()


def model_from_spec(spec: dict, code_dir: str | None | object = _FROM_SPEC) -> nn.Module:
    """Build the (freshly initialised) model a spec describes, a built-in family or the user's entrypoint
    (imported from `code_dir`: by default the folder the spec names; None: only what is importable, as
    in a registered model, which carries the code). The spec is kept as `model.shardline_spec`."""
    version = spec.get("version")
    if version not in SPEC_VERSIONS:
        raise ValueError(
            f"model spec version {version!r} is not supported (this Shardline reads {list(SPEC_VERSIONS)})"
        )
    cfg = ModelConfig.model_validate(spec["model"])
    data = data_spec_of(spec)
    if cfg.entrypoint:
        folder = cfg.code_dir if code_dir is _FROM_SPEC else code_dir
        model = build_user_model(cfg.entrypoint, cfg.params, data, folder)
    else:
        frames = {"fused": version >= 2} if cfg.family in FRAME_FAMILIES else {}
        model = FAMILIES[cfg.family](data, **builtin_params(cfg), **frames)
    model.shardline_spec = dict(spec)
    return model
