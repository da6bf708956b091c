"""Generating tokens from a model of a token column (the `gpt` family, or any model of the contract
over one token column), with a key/value cache.

The prompt runs through the model once; then each new token is fed alone, its keys and values
added to the cache, so a step costs one token's work whatever the prompt's length. The context is
the last K tokens (K: the model's window, `data.window`), as in training: a prompt longer than K
keeps its last K tokens, and once the sequence outgrows K each further token is computed from the
last K tokens again (positions are absolute, so cached keys cannot slide), exactly what recomputing
the whole context every step would give, at that cost.

A model without a cache (no `new_cache`) is run on the whole context every step, through its
`forward(cont, cat)`; it must accept windows shorter than K.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shardline.trainer.contract import as_outputs
from shardline.trainer.gpt import check_token_spec
from shardline.trainer.models import data_spec_of


def _check_args(prompt_ids, max_new_tokens: int, temperature: float, top_k: int | None, vocab: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token id (a separator or end-of-text id will do)")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} are outside the model's vocabulary 0..{vocab - 1}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be 0 or more")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature} must be 0 (greedy) or a finite number above it")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be 1 or more (or unset: every token)")
    return prompt


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    """One token from the last position's logits [vocab]: the most likely (temperature 0), or drawn from the
    softmax at `temperature` over the `top_k` most likely. Id 0 (padding, or a token never seen in training)
    is never produced."""
    logits = logits.float().clone()
    logits[0] = float("-inf")
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model: nn.Module, prompt_ids, max_new_tokens: int, *args, **kwargs) -> list[int]:
    """The token ids that follow `prompt_ids`, all at once: `generate_stream`'s (its arguments)."""
    return list(generate_stream(model, prompt_ids, max_new_tokens, *args, **kwargs))


def generate_stream(
    model: nn.Module,
    prompt_ids,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    stop_ids: tuple[int, ...] = (),
) -> Iterator[int]:
    """The token ids that follow `prompt_ids` (the new ones only, at most `max_new_tokens`), each as soon as it is
    drawn (what `shardline generate` prints as it goes; `generate` gives them all at once); generation stops before
    `eos_id` or any of `stop_ids`, which is not given. `temperature` 0 is greedy; `seed` makes sampling repeatable;
    `top_k` samples among the k most likely tokens only. `use_cache=False` recomputes the whole context for every
    token (the reference the cache must agree with). Each step runs in inference mode; the caller's code between
    tokens does not."""
    if not hasattr(model, "shardline_spec"):
        raise ValueError(
            f"{type(model).__name__} has no shardline_spec: build it with model_from_spec, or load it with load_model"
        )
    spec = data_spec_of(model.shardline_spec)
    vocab = check_token_spec(spec, family=type(model).__name__)
    prompt = _check_args(prompt_ids, max_new_tokens, temperature, top_k, vocab)
    target, window = spec.targets[0].name, spec.window
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))
    was_training = model.training
    model.eval()
    tokens, n = prompt[-window:], 0
    stops = {*stop_ids, *([] if eos_id is None else [eos_id])}
    cached = use_cache and callable(getattr(model, "new_cache", None))
    try:
        with torch.inference_mode():
            cache, filled = (model.new_cache(1), 0) if cached else (None, 0)
        while n < max_new_tokens:
            with torch.inference_mode():
                if cached and filled and filled < window:  # the one new token, at the next position
                    ids = torch.tensor([tokens[-1:]], device=device)
                    logits = model.logits(ids, cache, filled)
                    filled += 1
                elif cached:  # the first step, or the context outgrew the cache: the last K tokens from position 0
                    ids = torch.tensor([tokens[-window:]], device=device)
                    logits = model.logits(ids, cache, 0)
                    filled = ids.shape[1]
                else:
                    ids = torch.tensor([tokens[-window:]], device=device)
                    cont = torch.zeros((*ids.shape, 0), device=device)
                    logits = as_outputs(model(cont, ids[..., None]), spec)[target]
                token = next_token(logits[0, -1], temperature, top_k, generator)
            if token in stops:
                break
            n += 1
            tokens.append(token)
            yield token
    finally:
        model.train(was_training)


def continuations(
    model: nn.Module,
    tokenizer_json: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_at_sep: bool = False,
) -> list[str]:
    """Each prompt's continuation as text (`generate` one prompt at a time, decoded with the tokenizer the
    model was trained with): up to `<eos>`, or, for a generation target (`stop_at_sep`), up to the `<sep>`
    that ends a target in a sequence of several rows. `seed` seeds each prompt's draws alike, so a row's
    continuation does not depend on the rows beside it."""
    from shardline.core.encoding.text import EOS_ID, SEP_ID, decode

    stops = (SEP_ID,) if stop_at_sep else ()  # a target ends at its <sep>: nothing after it is generated
    out = []
    for ids in prompts:
        new = generate(model, ids or [SEP_ID], max_new_tokens, temperature, top_k, seed, eos_id=EOS_ID, stop_ids=stops)
        out.append(decode(tokenizer_json, new))
    return out
