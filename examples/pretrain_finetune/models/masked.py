"""Masked-frame pre-training, then fine-tuning with the backbone frozen: two models that share one
backbone (its parameters have the same names in both, `backbone.*`, so the fine-tune loads them from
the registered pre-trained model with `training.init_from`, and `training.freeze: [backbone.]`
keeps them as they were). Written from Shardline's model contract (README: "Your own model")."""

import torch
from torch import nn


class Backbone(nn.Module):
    """Frames -> contextual frame vectors [B, K, hidden]: every categorical column embedded, the frame
    projected, a learned position added, then a small bidirectional Transformer encoder."""

    def __init__(self, spec, hidden: int = 64, layers: int = 2, heads: int = 4, dim: int = 8):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(c, min(dim, c)) for c in spec.cardinalities)
        self.width = spec.n_cont + sum(min(dim, c) for c in spec.cardinalities)
        self.project = nn.Linear(self.width, hidden)
        self.position = nn.Parameter(torch.zeros(spec.window, hidden))
        layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)

    def frames(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        return torch.cat([cont.float(), *(e(cat[..., i]) for i, e in enumerate(self.embeddings))], dim=-1)

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        return self.norm(self.encoder(self.project(frames) + self.position[: frames.shape[1]]))

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        return self.encode(self.frames(cont, cat))


class MaskedFramePretrainer(nn.Module):
    """Hides a share of each window's frames behind a learned mask vector and reconstructs them from the
    others: their continuous features (squared error) and every categorical column's id (cross-entropy).
    No target column: the model's own `loss` is the objective."""

    def __init__(self, spec, hidden: int = 64, layers: int = 2, mask_rate: float = 0.25):
        super().__init__()
        self.backbone = Backbone(spec, hidden, layers)
        self.mask_vector = nn.Parameter(torch.zeros(self.backbone.width))
        self.reconstruct = nn.Linear(hidden, spec.n_cont)
        self.classify = nn.ModuleList(nn.Linear(hidden, c) for c in spec.cardinalities)
        self.mask_rate = mask_rate

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        frames = self.backbone.frames(cont, cat)
        # training draws from torch's RNG (checkpointed: a resumed run draws the same masks); evaluation
        # uses fixed masks, so validation losses compare across epochs
        gen = None if self.training else torch.Generator(cont.device).manual_seed(0)
        mask = torch.rand(frames.shape[:2], generator=gen, device=cont.device) < self.mask_rate
        frames = torch.where(mask[..., None], self.mask_vector.to(frames.dtype), frames)
        h = self.backbone.encode(frames)
        out = {"cont": self.reconstruct(h), "mask": mask}
        for i, head in enumerate(self.classify):
            out[f"cat_{i}"] = head(h)  # [B, K, cardinality]
        return out

    def _errors(self, outputs, cont, cat):
        """(squared error, absolute error, cross-entropy) of the hidden frames, each their mean."""
        mask = outputs["mask"]
        n = mask.sum().clamp(min=1)
        diff = (outputs["cont"].float() - cont.float())[mask]
        ce = sum(
            nn.functional.cross_entropy(outputs[f"cat_{i}"].float()[mask], cat[..., i][mask].long(), reduction="sum")
            for i in range(len(self.classify))
        )
        width = max(cont.shape[-1], 1)
        return diff.pow(2).sum() / (n * width), diff.abs().sum() / (n * width), ce / (n * max(len(self.classify), 1))

    def loss(self, outputs, cont, cat, targets) -> torch.Tensor:
        mse, _, ce = self._errors(outputs, cont, cat)
        return mse + ce

    def metrics(self, outputs, cont, cat, targets) -> dict[str, torch.Tensor]:
        mse, mae, ce = self._errors(outputs, cont, cat)
        return {"masked_mse": mse, "masked_mae": mae, "masked_cross_entropy": ce}


class FrameClassifier(nn.Module):
    """The pre-trained backbone (loaded by name) with one new head per target on the last frame."""

    def __init__(self, spec, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.backbone = Backbone(spec, hidden, layers)
        self.targets = list(spec.targets)
        self.heads = nn.ModuleDict(
            {
                t.name: nn.Sequential(
                    nn.Linear(hidden, hidden),
                    nn.GELU(),
                    nn.Linear(hidden, t.n_classes if t.kind == "classification" else 1),
                )
                for t in spec.targets
            }
        )

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        last = self.backbone(cont, cat)[:, -1]
        out = {}
        for t in self.targets:
            y = self.heads[t.name](last)
            out[t.name] = y if t.kind == "classification" else y[:, 0]
        return out
