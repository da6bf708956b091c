"""The built-in `gpt` family: a decoder-only Transformer over one token column, in the style of
nanoGPT (karpathy/nanoGPT, model.py), implementing the model contract like the other families.

Tokens and learned positions are embedded, go through `n_layer` pre-LayerNorm blocks (causal
self-attention through `torch.nn.functional.scaled_dot_product_attention`, then a GELU MLP), and a
final LayerNorm; the output layer is the token embedding itself (tied weights), so position k's
logits over the vocabulary predict the token after it. Weights start as nanoGPT's: N(0, 0.02), the
projections back into the residual stream scaled by 1/sqrt(2 * n_layer).

The data it takes: exactly one categorical column (the token ids, `cat` [B, K, 1]), no continuous or
boolean column, and one classification target over the same vocabulary predicted at every position
(`data.target_positions: all`); anything else is a `ModelContractError` that says what it needs.

Generation (`shardline/trainer/generate.py`) runs the model a token at a time with a key/value
cache (`new_cache`, `decode`): the prompt once, then one token per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardline.trainer.contract import DataSpec, ModelContractError


def check_token_spec(spec: DataSpec, family: str = "gpt") -> int:
    """The vocabulary size of a token data set (one categorical column, one classification target over the
    same ids at every position); anything else is an error naming what the family needs."""
    others = [*spec.continuous, *spec.boolean]
    if others or len(spec.categorical) != 1:
        raise ModelContractError(
            f"model.family: {family} reads exactly one token column (one categorical column of token ids, or a text "
            f"column) and no other feature; this data has categorical {spec.categorical}, continuous "
            f"{spec.continuous}, boolean {spec.boolean}: list only the token column under data.features"
        )
    vocab = int(spec.cardinalities[0])
    if len(spec.targets) != 1:
        raise ModelContractError(
            f"model.family: {family} predicts one target, the next token (the token column itself, or a text "
            f"target); this data has {len(spec.targets)}: {[t.name for t in spec.targets]}"
        )
    t = spec.targets[0]
    if t.kind != "classification" or t.positions != "all":
        raise ModelContractError(
            f"model.family: {family} predicts a token at every position: target '{t.name}' must be a classification "
            f"with data.target_positions: all (it is a {t.kind} at positions '{t.positions}')"
        )
    if t.n_classes != vocab:
        raise ModelContractError(
            f"model.family: {family} ties its output layer to the token embedding, so target '{t.name}' must have the "
            f"token column's ids: it has {t.n_classes} classes, '{spec.categorical[0]}' has {vocab} ids; predict the "
            "token column itself (data.target: {column: <the token column>, task: classification})"
        )
    return vocab


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)  # query, key, value of every head at once
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None, pos: int = 0):
        """x [B, T, C] -> [B, T, C]. With `cache` (this layer's keys and values [B, H, K, C/H]), the T new
        positions' keys and values are written at `pos`.. and the queries attend to positions 0..pos+T-1."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        mask, causal = None, True
        if cache is not None:
            keys, values = cache
            keys[:, :, pos : pos + t] = k
            values[:, :, pos : pos + t] = v
            k, v = keys[:, :, : pos + t], values[:, :, : pos + t]
            if pos > 0:  # new queries after cached ones: each sees every cached position and the new ones up to it
                causal = False
                if t > 1:
                    mask = torch.ones(t, pos + t, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, dropout, bias)

    def forward(self, x: torch.Tensor, cache=None, pos: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only Transformer over a window of K tokens: `forward(cont [B, K, 0], cat [B, K, 1])` ->
    `{target: logits [B, K, vocab]}`, position k's logits predicting the token after position k."""

    # learned positions, one row per position of the window: training.init_from refuses a parent of another
    # context rather than re-initialise them (trainer/contract.py load_matching)
    shardline_position_tables = ("wpe.weight",)

    def __init__(
        self,
        spec: DataSpec,
        d_model: int = 256,
        n_layer: int = 2,
        n_head: int = 4,
        dropout: float = 0.1,
        bias: bool = False,
    ):
        super().__init__()
        self.vocab_size = check_token_spec(spec)
        if d_model % n_head:
            raise ModelContractError(
                f"d_model={d_model} (model.hidden, or model.params.d_model) must be divisible by n_head={n_head} "
                "(model.heads, or model.params.n_head)"
            )
        self.target = spec.targets[0].name
        self.block_size = int(spec.window)  # the positions it has learned: its context length
        self.n_layer, self.n_head, self.d_model = n_layer, n_head, d_model
        self.wte = nn.Embedding(self.vocab_size, d_model)
        self.wpe = nn.Embedding(self.block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.lm_head = nn.Linear(d_model, self.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the output layer is the token embedding
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: residual projections scaled by the depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def logits(self, idx: torch.Tensor, cache: list | None = None, pos: int = 0) -> torch.Tensor:
        """Token ids [B, T] at positions pos..pos+T-1 -> logits [B, T, vocab]; with `cache` (from `new_cache`),
        positions before `pos` are read from it and these T are added to it."""
        t = idx.shape[1]
        if pos + t > self.block_size:
            raise ValueError(
                f"{pos + t} positions exceed the model's context of {self.block_size} tokens (data.window it was "
                "trained with)"
            )
        x = self.drop(self.wte(idx) + self.wpe.weight[pos : pos + t])
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i], pos)
        return self.lm_head(self.ln_f(x))

    def forward(self, cont: torch.Tensor, cat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.target: self.logits(cat[..., 0].long())}

    def new_cache(self, batch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Empty keys and values for `batch` sequences of up to `block_size` tokens: one pair per layer."""
        p = self.wte.weight
        shape = (batch, self.n_head, self.block_size, self.d_model // self.n_head)
        return [(p.new_zeros(shape), p.new_zeros(shape)) for _ in self.blocks]
